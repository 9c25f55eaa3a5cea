"""Diagnostic: held-out loss split into corrupted / clean canvas positions, and per position at t = 1.
Reads the latest tools/train_small_model.py checkpoint in DIR (64 held-out windows, prefix 32).
    python tools/diag_small_model.py /work/train/ckpt
"""

import glob
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DiffusionGemmaForBlockDiffusion

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import train_small_model as T

torch.set_num_threads(1)
ck = sorted(glob.glob(sys.argv[1] + "/step_*.pt"))[-1]
st = torch.load(ck, weights_only=False)


class A:
    pass


a = A()
[setattr(a, k, v) for k, v in st["args"].items()]

m = DiffusionGemmaForBlockDiffusion(T.make_config(a, 2048))
m.load_state_dict(st["model"])
m.eval()
held = np.load("/work/train/held.npy").astype(np.int64)
hb = T.heldout_batches(held, 16, n=64, prefix_lens=(32,))
g = torch.Generator().manual_seed(0)
P, w = hb[0]
pre, tgt = w[:, :P], w[:, P:]
with torch.no_grad():
    for t in (0.25, 0.5, 0.75, 1.0):
        u = torch.rand(tgt.shape, generator=g)
        noise = torch.randint(0, 2048, tgt.shape, generator=g)
        cor = u < t
        noisy = torch.where(cor, noise, tgt)
        loss = F.cross_entropy(
            T.canvas_logits(m, pre, noisy, None).reshape(-1, 2048), tgt.reshape(-1), reduction="none"
        ).view(tgt.shape)
        clean = loss[~cor].mean() if (~cor).any() else float("nan")
        print(
            ck.split("/")[-1],
            f"t={t} corrupted {loss[cor].mean():.3f} clean {clean:.3f} per-pos(t=1) "
            + (" ".join(f"{x:.2f}" for x in loss.mean(0).tolist()) if t == 1.0 else ""),
        )
