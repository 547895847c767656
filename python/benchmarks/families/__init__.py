"""Benchmark families: each module exposes ``run(quick: bool) -> list[Row]``."""
