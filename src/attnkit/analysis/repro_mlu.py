"""MLU at CPU scale ("Compositional De-Attention Networks", section 3.6, Table 6; ablations Tables 8-9).

The paper trains a Transformer and a CoDA Transformer for 100k steps on MLU (operands in [-1000, 1000), ``+
- *``) and reports sequence accuracy 76.1 (Transformer) vs 84.3 (CoDA). At 1500 CPU steps neither model
learns that task at all (about 1%), so the comparison would say nothing. ``mlu`` therefore shrinks the task,
a stated deviation: operands in ``[-RANGE, RANGE)`` (default 16: results up to three digits; 2400 training
expressions), the same operators and the same random assignment order, a small encoder-decoder (2 + 2
layers, d 64) and 600 Adam steps (batch 64, one-cycle schedule, peak lr 3e-3; 22 s of CPU time on one thread;
1500 steps at lr 1e-3 had given 0%). That budget was chosen when softmax reached 63% sequence accuracy on
seed 0, before the overlap between train and test expressions was removed; on disjoint splits it reaches
about 0.45 (0.447 +- 0.029 over seeds 0-2 at the full budget), so the precondition claim "softmax learns
(>= 50%)" does not hold at this budget. Then softmax vs CoDA and the paper's ablations:
gate variants (plain sigmoid, 2 sigmoid = eq. 5, centered = eq. 4), centering E (Table 8) and the Table 9
activations (with the gate mapped onto [0, 1], see ``attnkit.mechanisms.coda``), over seeds.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..config import CoDA
from ..data.mlu import MLUConfig, generate_mlu, sequence_accuracy
from ..data.tokenizers import CharTokenizer
from ..models import Seq2SeqTransformer
from .report import Claim, ReproduceResult, exceeds, spread, write_csv

__all__ = ["train_mlu", "mlu_ablations", "MLU_VARIANTS"]

# Table 6: Transformer 76.1%, CoDA Transformer 84.3% (sequence accuracy, 100k steps); as fractions, the unit
# of our "sequence accuracy" column beside them.
PAPER_TABLE6 = {"softmax": 0.761, "coda": 0.843}
MLU_VARIANTS = {
    "softmax": "softmax",
    "coda (2 sigmoid, eq. 5)": CoDA(gate="scaled"),
    "coda sigmoid gate": CoDA(gate="sigmoid"),
    "coda centered N (eq. 4)": CoDA(gate="centered"),
    "coda centered E (Table 8)": CoDA(gate="scaled", center_e=True),
    "coda tanh(E) x tanh gate (Table 9)": CoDA(gate="scaled", n_activation="tanh"),
    "coda sigmoid(E) x sigmoid(N) (Table 9)": CoDA(gate="scaled", e_activation="sigmoid"),
}
# Table 9 varies the activations of E and N and nothing else: its compositions among the variants (the
# others change the gate's scaling or centre E or N, Table 8's ablation)
TABLE9_COMPOSITIONS = (
    "coda (2 sigmoid, eq. 5)", "coda tanh(E) x tanh gate (Table 9)", "coda sigmoid(E) x sigmoid(N) (Table 9)",
)


def train_mlu(
    mechanism,
    steps: int,
    seed: int,
    value_range: int = 16,
    num_train: int = 2400,
    num_test: int = 400,
    batch_size: int = 64,
    lr: float = 3e-3,
    d_model: int = 64,
) -> float:
    """Train the encoder-decoder on MLU, operands in ``[-value_range, value_range)``; test sequence accuracy.

    Encoder self-attention and decoder cross-attention use ``mechanism``; decoder self-attention (causal) is
    softmax for query-normalized mechanisms and CoDA for CoDA (the CoDA Transformer replaces every attention).
    A centered CoDA variant uses the uncentered eq. 5 gate, with the same activations, in both attentions of
    the decoder: its means over every (query, key) pair would see later target positions there (in the
    cross-attention too, whose queries are the decoder positions), so teacher-forced training would not
    match step-by-step decoding.
    """
    data = generate_mlu(
        MLUConfig(
            num_train=num_train, num_test=num_test, low=-value_range, high=value_range, seed=1000 + seed
        )
    )
    tok = CharTokenizer()
    torch.manual_seed(seed)

    def encode(texts, bos: bool, eos: bool):
        rows = [tok.encode_ids(t, add_bos=bos, add_eos=eos) for t in texts]
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        return ids

    src, tgt = (
        encode(data.train_src, False, False),
        encode(data.train_tgt, True, True),
    )  # (N, Ls), (N, Lt + 2)
    is_coda = isinstance(mechanism, CoDA)
    # The centered variants (eqs. 4, 6) average over all pairs, which would leak future target positions in
    # both attentions of the decoder: there they use the uncentered gate of eq. 5 with the same activations.
    causal = mechanism
    if is_coda and (mechanism.gate == "centered" or mechanism.center_e):
        causal = CoDA(gate="scaled", alpha=mechanism.alpha, beta=mechanism.beta,
                      e_activation=mechanism.e_activation, n_activation=mechanism.n_activation)
    model = Seq2SeqTransformer(
        tok.vocab_size,
        tok.vocab_size,
        d_model=d_model,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=4 * d_model,
        dropout=0.0,
        encoder_mechanism=mechanism,
        decoder_mechanism=causal if is_coda else "softmax",
        cross_mechanism=causal if is_coda else "softmax",
        max_len=32,
    )
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1), pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(src), (batch_size,), generator=g)
        y = tgt[idx]
        y_in, y_out = y[:, :-1], y[:, 1:]
        logits = model(src[idx], src[idx] != 0, y_in, y_in != 0)
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y_out.reshape(-1), ignore_index=0
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    test_src = encode(data.test_src, False, False)
    out = model.greedy_decode(test_src, test_src != 0, max_len=8, bos_id=tok.bos_id, eos_id=tok.eos_id)
    preds = tok.decode(out, generated=True)  # (B,) strings: stops at <eos>; a generated pad/bos is wrong
    return sequence_accuracy(preds, data.test_tgt)


def _quick_note(steps: int, softmax: float) -> str:
    return (
        f"quick: one seed of softmax and CoDA at {steps} steps, the budget at which softmax had reached 63% "
        "before the train/test overlap was removed; on disjoint splits it reaches about 0.45 (0.447 +- 0.029 "
        f"over 3 seeds at the full budget; this run {softmax:.3f}), below the 50% precondition; no spread "
        "over seeds, and the Table 8/9 ablations run only in full mode"
    )


def mlu_ablations(result: ReproduceResult, quick: bool = False, seed: int = 0) -> None:
    # 600 steps: the budget at which softmax had reached 63% on seed 0 before the train/test overlap was
    # removed (now about 0.45, below the 50% precondition). Quick mode keeps it and runs one seed of softmax
    # and CoDA instead of three seeds of every variant.
    n_seeds, steps = (1, 600) if quick else (3, 600)
    variants = dict(list(MLU_VARIANTS.items())[:2]) if quick else MLU_VARIANTS
    seeds = list(range(seed, seed + n_seeds))
    result.budget = (
        f"{n_seeds} seed{'s' if n_seeds > 1 else ''} x {steps} Adam steps (batch 64, one-cycle lr 3e-3), "
        "2+2 layers d 64; "
        "MLU with operands in [-16, 16), 2400 train / 400 test expressions (paper: [-1000, 1000), "
        "100k steps)"
    )
    acc = {name: [train_mlu(mech, steps, s) for s in seeds] for name, mech in variants.items()}
    result.add_file(
        write_csv(
            result.out / "mlu.csv",
            [
                {"variant": n, "seed": s, "sequence_accuracy": a}
                for n, v in acc.items()
                for s, a in zip(seeds, v)
            ],
        )
    )
    for name, v in acc.items():
        result.rows.append(
            {
                "variant": name,
                "seeds": n_seeds,
                "sequence accuracy": spread(v),
                "paper (Table 6)": PAPER_TABLE6.get(name.split(" ")[0], float("nan"))
                if name in ("softmax", "coda (2 sigmoid, eq. 5)")
                else float("nan"),
            }
        )
    soft, coda = np.mean(acc["softmax"]), np.mean(acc["coda (2 sigmoid, eq. 5)"])
    if quick:
        result.note = _quick_note(steps, soft)
    beats = exceeds(acc["coda (2 sigmoid, eq. 5)"], acc["softmax"])  # beyond the seeds' noise
    result.claims += [
        Claim(
            "CoDA Table 6 (precondition)",
            "the softmax Transformer learns the task (>= 50% sequence accuracy)",
            soft >= 0.5,
            f"softmax mean sequence accuracy {soft:.3f} at this budget",
            paper="0.761 (76.1%)",
            ours=spread(acc["softmax"]),
            criterion="different",
        ),
        Claim(
            "CoDA Table 6",
            "the CoDA Transformer beats the Transformer on MLU",
            beats[0],
            f"mean sequence accuracy CoDA {coda:.3f} vs softmax {soft:.3f} (operands in [-16, 16)); "
            f"{beats[1]}",
            paper="0.843 vs 0.761 (84.3% vs 76.1%)",
            ours=f"{spread(acc['coda (2 sigmoid, eq. 5)'])} vs {spread(acc['softmax'])}",
            criterion="different",
        ),
    ]
    if not quick:
        table9 = {n: float(np.mean(acc[n])) for n in TABLE9_COMPOSITIONS}
        best, runner_up = sorted(table9, key=table9.get, reverse=True)[:2]
        clear = exceeds(acc[best], acc[runner_up])  # the best beyond the seeds' noise of the next one
        result.claims.append(
            Claim(
                "CoDA Table 9",
                "tanh(E) x sigmoid(N) is the best composition",
                best == "coda (2 sigmoid, eq. 5)" and clear[0],
                "mean accuracy per Table 9 composition: "
                + ", ".join(f"{n} {a:.3f}" for n, a in table9.items())
                + f"; best - next ({runner_up}): {clear[1]}",
                paper="27.8 BLEU best",
                ours=f"best: {best}",
                criterion="different",
            )
        )
