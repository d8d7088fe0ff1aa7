"""Patch `flash_attn_stub`: let openrlhf import without the flash-attn package.

Why: `openrlhf/models/ring_attn_utils.py` (reached from `import openrlhf.models`, so from the Ray launcher
every driver imports) imports `flash_attn.bert_padding` and `flash_attn.utils.distributed` at module level.
flash-attn cannot be built without CUDA, and on GPUs it is a source build against each node's torch; yet
only `--ds.packing_samples` and ring attention use it, and SDPA attention needs none of it. The four helpers
it imports are plain torch. Upstream candidate: import them lazily inside the ring-attention functions.

Applied in every mode (compat.EVERY_MODE), on GPUs too, and only where flash-attn is not installed; the
launcher refuses flash attention, packing and ring attention there, naming the install.

How: while ring_attn_utils executes, stand-in `flash_attn` modules holding our own torch versions of
those helpers sit in `sys.modules`; they are removed right after, so nothing else in the process
(transformers' flash-attn detection included) ever sees a fake flash_attn. Does nothing if the real
package is installed.
"""

import importlib.util
import sys
import types

import torch
import torch.nn.functional as F

FITS = ("0.11.2",)
_STUB_NAMES = ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed")


def rearrange(tensor, pattern, **axes):
    import einops

    return einops.rearrange(tensor, pattern, **axes)


def index_first_axis(x, indices):
    """Rows `indices` of x viewed as (first axis, rest)."""
    return x.reshape(x.shape[0], -1)[indices].reshape(-1, *x.shape[1:])


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(B, S, ...) + (B, S) mask -> (tokens, ...), flat indices, cu_seqlens, max_seqlen, seqlens."""
    mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    used_seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max().item()), used_seqlens


def pad_input(hidden_states, indices, batch, seqlen):
    """Inverse of unpad_input: scatter tokens back into a zero (B, S, ...) tensor."""
    out = torch.zeros(
        batch * seqlen, *hidden_states.shape[1:], device=hidden_states.device, dtype=hidden_states.dtype
    )
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


class AllGather(torch.autograd.Function):
    """flash-attn's all_gather: `x` of every rank of `group` concatenated along dim 0. Its gradient is each
    rank's slice of the gradient summed over the group: ring attention's log-probs are gathered so, and
    trained through. flash-attn reduce-scatters; gloo has no reduce-scatter, so all-reduce, then slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        rank, world = torch.distributed.get_rank(ctx.group), torch.distributed.get_world_size(ctx.group)
        return grad.chunk(world, dim=0)[rank], None


def all_gather(input_, group=None):
    return AllGather.apply(input_, group)


def before_exec(module):
    if importlib.util.find_spec("flash_attn") is not None:
        return
    from openrlhf_mappa.compat import check_version

    check_version("flash_attn_stub", "openrlhf", FITS)
    stubs = {name: types.ModuleType(name) for name in _STUB_NAMES}
    stubs["flash_attn"].__path__ = []
    stubs["flash_attn.utils"].__path__ = []
    for name in ("index_first_axis", "pad_input", "rearrange", "unpad_input"):
        setattr(stubs["flash_attn.bert_padding"], name, globals()[name])
    stubs["flash_attn.utils.distributed"].all_gather = all_gather
    for name, stub in stubs.items():
        sys.modules.setdefault(name, stub)
        stub.__mappa_stub__ = True


def after_exec(module):
    for name in _STUB_NAMES:
        if getattr(sys.modules.get(name), "__mappa_stub__", False):
            del sys.modules[name]


def apply(module):
    pass
