"""The tools on top: `dsv4-generate`, the benchmarks (`dsv4-bench`, `dsv4-bench-serve`, the
speculation and IndexCache reports, the server comparison), `dsv4-plan` and ahead-of-time
compilation for TPU and GPU targets, the kernels' compile report, random checkpoints."""
