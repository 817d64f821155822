"""megaloop's benchmarks, one module a bench, run as `python -m bench NAME [--smoke] [--out DIR]`
(bench/__main__.py; docs/benchmarks.md). What two benches share lives in bench/common/."""
