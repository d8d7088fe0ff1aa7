"""Patch `bnb_cpu_training`: a 4-bit layer that ran in eval mode still trains, on CPUs with AVX512-BF16.

Why: bitsandbytes' `Linear4bit.forward`, on a CPU with AVX512-BF16, repacks its weight into a CPU inference
layout the first time it runs in eval mode without gradients (QLoRA's reference log-probs, the experience
maker's forward), and keeps it: every later forward, training ones too, takes that layout's kernel, whose
`result += bias` in place raises "a view of a leaf Variable that requires grad is being used in an in-place
operation" (and which has no backward to the layer's input). Machines without AVX512-BF16 never repack.
Upstream candidate (bitsandbytes): repack only when no module of the model trains, or unpack on `train()`.

How: the module's `has_avx512bf16` answers False, so Linear4bit layers built after it keep the layout that
trains.
"""

from openrlhf_mappa.compat import check_version, refuse_outside_cpu_mode

refuse_outside_cpu_mode(__name__)

FITS = ("0.50.2",)


def apply(module) -> None:
    check_version("bnb_cpu_training", "bitsandbytes", FITS)
    module.has_avx512bf16 = lambda: False
