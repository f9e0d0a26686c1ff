"""Launch the data-parallel page's ranks many times in a row and count the
launches that fail: the check that two gloo ranks on one machine end
cleanly (issue 35: they used to abort at teardown in about one launch of
six). Each launch is what the page runs in quick mode: two ranks over gloo,
the gradient check under DDP and FSDP2 and once with the count not reduced,
then a few timed AdamW steps under DDP. Not part of CI (it takes minutes)::

    .venv/bin/python scripts/repeat_ranks.py [--launches 50]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ragged_toolkit.data import pack_documents, split_by_token_budget
from ragged_site.corpus import docstring_corpus
from ragged_site.data_parallel_launch import (DataParallelJob, GradientRun, run_data_parallel)  # noqa: E402
from ragged_toolkit.gpt import GPT, GPTConfig  # noqa: E402

MODEL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=512)


def job_and_data(world=2, budget=256, steps=3):
    documents, _ = docstring_corpus(limit=200)
    tokens, offsets = pack_documents(documents, max_len=512)
    micro = split_by_token_budget(tokens, offsets, budget)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    runs = [GradientRun("DDP", "ddp"), GradientRun("FSDP2", "fsdp"),
            GradientRun("DDP, count not reduced", "ddp", reduce_count=False)]
    job = DataParallelJob(backend="gloo", config=MODEL, grad_runs=runs)
    per_step = [[micro[s * world * 2 + r * 2: s * world * 2 + r * 2 + 2] for r in range(world)]
                for s in range(1, steps + 1)]
    data = {"init": model.state_dict(), "grad_batches": [micro[r::world][:2] for r in range(world)],
            "time_batches": {"token budget": per_step}}
    return job, data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=50)
    args = ap.parse_args(argv)
    job, data = job_and_data()
    failures, seconds = [], []
    for i in range(args.launches):
        start = time.monotonic()
        try:
            run_data_parallel(job, data, 2, timeout=300)
        except Exception as err:  # a failed launch: keep its ranks' own errors
            failures.append((i, str(err)))
            print(f"launch {i + 1}: FAILED\n{err}", flush=True)
        seconds.append(time.monotonic() - start)
        print(f"launch {i + 1}/{args.launches}: {seconds[-1]:.1f} s, {len(failures)} failed so far", flush=True)
    print(f"repeat_ranks: {args.launches - len(failures)} of {args.launches} launches passed, "
          f"{sum(seconds):.0f} s in all ({sum(seconds) / len(seconds):.1f} s each)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
