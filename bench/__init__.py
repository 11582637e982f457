"""Side-by-side benchmarks of rsb: ``python3 -m bench SCENARIO [options]`` (see docs/benchmarks.md)."""
