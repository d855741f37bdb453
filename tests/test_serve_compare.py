"""`python -m dsv4_jax.tools.serve_compare`: its comparison of bench reports, and bad input rejected
before any server starts (a live run is what docs/serving.md's tables come from)."""

import pytest

from dsv4_jax.tools import serve_compare


def _report(throughput, ttft, tpot):
    stats = lambda v: {"mean": v, "p90": 2 * v}  # noqa: E731
    return {"all": {"output_throughput": throughput, "ttft_ms": stats(ttft), "tpot_ms": stats(tpot),
                    "itl_ms": stats(tpot), "e2el_ms": stats(ttft + 100 * tpot)}}


def test_compare_puts_every_server_beside_the_first():
    out = serve_compare.compare({"off": _report(100.0, 50.0, 10.0), "on": _report(125.0, 20.0, 8.0)})
    assert out["off"]["output_throughput_change_pct"] == 0.0
    on = out["on"]
    assert on["output_throughput"] == 125.0 and on["output_throughput_change_pct"] == pytest.approx(25.0)
    assert on["ttft_ms"] == {"mean": 20.0, "p90": 40.0, "mean_ratio_to_first": 0.4, "p90_ratio_to_first": 0.4}
    assert on["tpot_ms"]["mean_ratio_to_first"] == pytest.approx(0.8)
    assert on["e2el_ms"]["mean"] == 820.0


@pytest.mark.parametrize("args, message", [
    (["--ckpt", "{ckpt}", "--server", "noequals"], "--server must be NAME="),
    (["--ckpt", "{ckpt}", "--server", "a=", "--server", "a=--slots 2"], "distinct names"),
    (["--ckpt", "{ckpt}/missing", "--server", "a="], "checkpoint directory not found"),
    (["--ckpt", "{ckpt}", "--server", "a=", "--", "--input-len", "0", "--vocab-size", "8"], "--input-len must be >= 1"),
    (["--ckpt", "{ckpt}", "--server", "a=", "--out", "{ckpt}/no/such/dir/out.json", "--", "--vocab-size", "8"],
     "No such file or directory"),
])
def test_bad_input_fails_before_any_server_starts(tmp_path, capsys, monkeypatch, args, message):
    started = []
    monkeypatch.setattr(serve_compare, "run_server", lambda *a: started.append(a))
    assert serve_compare.main([a.format(ckpt=tmp_path) for a in args]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not started
