"""dsv4-train (dsv4_jax/training/, dsv4_jax/tools/train.py): a tiny preset trained for a minute
learns (its loss falls, its held-out loss goes below the unigram baseline), its directory loads
and serves as a checkpoint, speculative greedy output equals plain greedy on it, a run resumes
where it stopped, data parallelism on two devices computes the same step, the fine-tuning
example tunes, and bad input is one line. The indexer's loss teaches the indexer only."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_oracle import TINY

import dsv4_jax
from dsv4_jax.model.cache import init_cache
from dsv4_jax.model.indexer import distillation_kl
from dsv4_jax.tools import train as train_cli
from dsv4_jax.training import data, objective
from dsv4_jax.training.trainer import Trainer, TrainSettings, init_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 60  # the tiny preset's run: at 40 steps the held-out loss is barely below the unigram one


def _corpus(tmp_path, n_files=30, size=6000):
    """A corpus of Python files copied from this repository (real text, a few hundred KB)."""
    src = sorted(p for d in ("dsv4_jax", "tests") for p in __import__("glob").glob(os.path.join(ROOT, d, "**/*.py"),
                                                                                    recursive=True))
    out = tmp_path / "corpus"
    out.mkdir()
    for i, p in enumerate(src[:n_files]):
        (out / f"{i:03d}_{os.path.basename(p)}").write_text(open(p).read()[:size])
    return str(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run of STEPS steps on one device: (its directory, its per-step losses, its summary,
    the corpus, the Trainer)."""
    tmp = tmp_path_factory.mktemp("train")
    corpus = _corpus(tmp, n_files=200, size=20000)
    seen = []
    trainer = Trainer.start(TrainSettings(out=str(tmp / "run"), preset="tiny", corpus=(corpus,), steps=STEPS,
                                          indexer_warmup=5, devices=1))
    summary = trainer.train(lambda step, steps, parts, tps: seen.append(parts))
    return tmp / "run", seen, summary, corpus, trainer


def test_the_loss_falls_below_the_unigram_baseline(run):
    out, seen, summary, _, trainer = run
    assert len(seen) == STEPS and summary["steps"] == STEPS
    first = np.mean([p["lm"] for p in seen[:3]])
    assert summary["train_loss"] < first - 0.8, (first, summary["train_loss"])
    # a model that learned nothing beyond token frequencies would sit at the unigram loss
    assert summary["eval_loss"] < summary["unigram_loss"] - 0.1, summary
    assert all(np.isfinite(p["mtp"]) and np.isfinite(p["indexer"]) and p["indexer"] >= 0 for p in seen)
    assert seen[-1]["mtp"] < seen[0]["mtp"] - 0.8  # the MTP block learns too
    for key in ("train_loss", "eval_loss", "unigram_loss", "tokens", "seconds"):
        assert key in summary
    assert summary["tokens"] == STEPS * 4 * 256


def test_the_directory_is_a_checkpoint_that_generates_and_speculates(run):
    out, _, summary, _, _ = run
    assert dsv4_jax.ModelConfig.from_hf(str(out)).num_nextn_predict_layers == 1
    model = dsv4_jax.load(str(out), mtp=True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt = tok.encode("import os\n\n\ndef main(argv=None):\n    ").ids
    plain = dsv4_jax.generate(model, [prompt], 24)
    spec = dsv4_jax.generate(model, [prompt], 24, speculative_tokens=2)
    assert spec.rows() == plain.rows()
    assert spec.speculation["spec_decode_num_drafts"] > 0
    # the greedy tokens are the teacher-forced argmax rollout of the saved model
    ids = prompt + plain.rows()[0]
    logits = np.asarray(model(np.asarray([ids[:-1]], np.int32)))
    np.testing.assert_array_equal(np.argmax(logits[0, len(prompt) - 1:], -1), plain.rows()[0])


def test_a_run_resumes_where_it_stopped(run, tmp_path):
    out, _, summary, _, _ = run
    import shutil

    copy = tmp_path / "resumed"
    shutil.copytree(out, copy)
    saved = dsv4_jax.load(str(copy), mtp=True)
    resumed = Trainer.resume(str(copy), steps=STEPS + 2)
    assert resumed.step == STEPS and resumed.tokens == summary["tokens"]
    for a, b in zip(jax.tree.leaves(resumed.params["main"]["layers"]), jax.tree.leaves(saved.params["layers"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    after = resumed.train()
    assert after["steps"] == STEPS + 2 and after["tokens"] == summary["tokens"] + 2 * 4 * 256
    assert dsv4_jax.load(str(copy)).config.vocab_size == 512


def test_data_parallel_on_two_devices_computes_the_same_step(run):
    """One training step on a two-device mesh (batch split over the data axis, parameters placed
    by the model's sharding rules) equals the one-device step from the same state: fp32, 1e-4
    relative on the losses, the expert load exactly, and the updated weights (the reductions are
    split differently). The one-device side is the run's own trainer (its program compiled)."""
    one = run[4]
    params, opt_state = jax.tree.map(jnp.copy, (one.params, one.opt_state))  # the programs donate their inputs
    two = Trainer(dataclasses.replace(one.settings, devices=2), one.cfg, one.tok, one.corpus, params, one.frozen,
                  opt_state, one.step, one.tokens, one.seconds)
    assert one.mesh is None and two.mesh is not None
    assert len(two.params["main"]["embed"].sharding.device_set) == 2
    results = []
    for t in (one, two):
        windows = t._windows(t.corpus.batch(0, 0, 4, 256))
        state = jax.tree.map(jnp.copy, (t.params, t.opt_state))
        params, _, parts, load = t._program("train", False)(state[0], t.frozen, state[1], windows)
        results.append((jax.tree.map(np.asarray, parts), np.asarray(load), np.asarray(params["main"]["gate_bias"]),
                        np.asarray(params["main"]["layers"]["attn"]["wq_a"])))
    for k in results[0][0]:
        np.testing.assert_allclose(results[1][0][k], results[0][0][k], rtol=1e-4)
    np.testing.assert_array_equal(results[1][1], results[0][1])
    np.testing.assert_array_equal(results[1][2], results[0][2])
    np.testing.assert_allclose(results[1][3], results[0][3], rtol=1e-4, atol=1e-6)


def test_expert_balancing_moves_the_gate_biases_against_the_load(run):
    """objective.balanced raises an underloaded expert's bias by the rate and lowers an overloaded
    one's (hash-routed layers have no bias); in the run the biases moved by whole steps of it and
    the summary reports each learned layer's max violation."""
    _, _, summary, _, trainer = run
    cfg = trainer.cfg  # layer 0 hash-routed, 1-3 learned; 4 experts
    load = jnp.asarray([[9, 9, 9, 9], [8, 0, 2, 6], [4, 4, 4, 4], [0, 0, 0, 16]], jnp.int32)
    np.testing.assert_allclose(objective.balanced(jnp.zeros((3, 4), jnp.float32), load, cfg, 0.5),
                               [[-0.5, 0.5, 0.5, -0.5], [0, 0, 0, 0], [0.5, 0.5, 0.5, -0.5]])
    np.testing.assert_allclose(objective.max_violation(load, cfg), [1.0, 0.0, 3.0])
    moved = np.asarray(trainer.params["main"]["gate_bias"]) / trainer.settings.balance_rate
    assert 0 < np.abs(moved).max() <= STEPS + 1e-3
    np.testing.assert_allclose(moved, np.round(moved), atol=1e-3)  # each step moves a bias by -1, 0 or +1 rate
    assert len(summary["eval_expert_max_violation"]) == 3 and min(summary["eval_expert_max_violation"]) >= 0


def test_the_fine_tuning_example(run, tmp_path):
    out, _, _, corpus, _ = run
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fine_tune.py"), str(out), "--text",
                           os.path.join(ROOT, "README.md"), "--out", str(tmp_path / "tuned"), "--steps", "4"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loss_after"] < result["loss_before"] and result["reloaded_equal"] is True
    assert dsv4_jax.load(str(tmp_path / "tuned"), mtp=True).mtp is not None


def _cli(argv, capsys):
    rc = train_cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


def test_bad_input_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    small = tmp_path / "small"
    small.mkdir()
    for i in range(3):
        (small / f"f{i}.py").write_text("x = 1\n")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY, "vocab_size": 100}))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    cases = [
        (["--out", str(tmp_path / "o1"), "--corpus", str(empty), "--devices", "1"], "no text files in the corpus"),
        (["--out", str(tmp_path / "o2"), "--corpus", str(tmp_path / "missing")], "corpus path not found"),
        (["--out", str(tmp_path / "o3"), "--corpus", str(small), "--devices", "1"], "the corpus is too small"),
        (["--out", str(blocker / "o4"), "--corpus", str(small)], "cannot write the output directory"),
        (["--out", str(used), "--corpus", str(small)], "is not empty (--resume continues"),
        (["--out", str(tmp_path / "o5"), "--config", str(config), "--corpus", str(small)], "vocab_size 100 is below"),
        (["--out", str(tmp_path / "o6"), "--preset", "huge"], "unknown preset 'huge'"),
        (["--out", str(tmp_path / "o7"), "--steps", "0"], "--steps must be >= 1"),
        (["--out", str(tmp_path / "o8"), "--resume"], "has no training checkpoint to resume"),
        (["--out", str(tmp_path / "o9"), "--resume", "--lr", "1"], "--resume continues the run as it was saved"),
    ]
    for argv, message in cases:
        rc, err = _cli(argv, capsys)
        assert rc == 1 and len(err) == 1 and message in err[0], (argv, err)
        assert err[0].startswith("dsv4-train: error: ")
    # nothing is left behind by a new run that failed
    for name in ("o1", "o3", "o5"):
        assert not (tmp_path / name).exists(), name
    assert not (blocker.parent / "o4").exists()


def test_the_indexer_loss_teaches_the_indexer_only():
    """The indexer's KL is 0 when its distribution is the main attention's, positive otherwise;
    in the model its gradient reaches the indexer's weights and nothing of the main model."""
    rng = np.random.default_rng(0)
    B, T, H, D, N, K = 2, 5, 3, 8, 6, 4
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((B, N, D)), jnp.float32)
    ids = jnp.asarray(np.stack([[rng.permutation(N)[:K] for _ in range(T)] for _ in range(B)]), jnp.int32)
    ids = ids.at[0, 0, 2:].set(-1).at[1, 1].set(-1)  # a query choosing two entries, one choosing none
    logits = jnp.einsum("bthd,bnd->bthn", q, rows) * 0.5
    chosen = jnp.take_along_axis(logits, jnp.where(ids >= 0, ids, 0)[:, :, None], -1)
    p = jnp.sum(jax.nn.softmax(jnp.where(ids[:, :, None] >= 0, chosen, -jnp.inf), -1), 2) / H
    matching = jnp.zeros((B, T, N)).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None],
                                       jnp.where(ids >= 0, ids, N - 1)].set(jnp.log(jnp.where(ids >= 0, p, 1.0)))
    assert abs(float(distillation_kl(q, rows, matching, ids, 0.5))) < 1e-5
    assert float(distillation_kl(q, rows, jnp.zeros((B, T, N)), ids, 0.5)) > 1e-3
    g = jax.grad(lambda q: distillation_kl(q, rows, jnp.zeros((B, T, N)), ids, 0.5))(q)
    assert float(jnp.max(jnp.abs(g))) == 0.0  # the target is held constant

    cfg = dsv4_jax.ModelConfig.from_hf(TINY).replace(attention_impl="ref")
    params, frozen = init_model(cfg, 0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 40)), jnp.int32)

    def kl(main):
        out = dsv4_jax.step({**main, **frozen}, init_cache(cfg, 2, 40), ids, cfg, indexer_kl=True)
        return jnp.nansum(out.indexer_kl)

    value, grads = jax.jit(jax.value_and_grad(kl))(params["main"])  # one program, not op by op
    assert float(value) > 0
    indexer = jax.tree.leaves(grads["csa"]["indexer"])
    assert max(float(jnp.max(jnp.abs(x))) for x in indexer) > 0
    rest = {k: v for k, v in grads.items() if k != "csa"} | {"csa_rest": grads["csa"]["compressor"]}
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(rest)) == 0.0


def test_held_out_files_never_train(tmp_path):
    corpus = _corpus(tmp_path, n_files=60)
    files = data.corpus_files([corpus])
    held = [f for f in files if data.held_out(f)]
    assert held and len(held) < len(files) // 5
    # the split is by path, the same on every call and every machine
    assert held == [f for f in data.corpus_files([corpus]) if data.held_out(f)]


def test_the_quality_report_on_the_trained_run(run, capsys):
    """`python -m dsv4_jax.tools.quality` on the run: held-out loss below the unigram baseline as
    the trainer measured it, IndexCache's settings on the run's two ratio-4 layers; bad input is
    one line."""
    from dsv4_jax.tools import quality

    out, _, summary, _, _ = run
    rc = quality.main([str(out), "--sections", "loss,index-cache", "--windows", "8", "--prompts", "2",
                       "--prompt-len", "64"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert report["loss"]["unigram_loss"] == pytest.approx(summary["unigram_loss"])
    assert report["loss"]["loss"] < report["loss"]["unigram_loss"]
    assert report["loss"]["loss"] == pytest.approx(report["index_cache"]["off"]["loss"])
    reusing = report["index_cache"]["freq 2"]
    layer = reusing["per_reusing_layer"]["3"]
    assert reusing["reusing_layers"] == [3] and 0 <= layer["overlap"] <= 1 and 0 <= layer["attention_js"] <= np.log(2)
    assert reusing["kl_next_token_vs_reference"] >= 0
    assert quality.main([str(out / "missing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a checkpoint directory" in err[0]
