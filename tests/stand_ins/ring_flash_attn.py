"""Stand-in for the `ring_flash_attn` package on CPU, for tests only (tests put this folder on PYTHONPATH).

Ring attention runs on flash-attn's CUDA kernels, which cannot exist here, so only the kernel is replaced: the two
functions OpenRLHF calls (deepspeed.setup_ring_attn, ring_attn_utils.update_ring_attn_params) with their real
signatures. Each rank's queries attend to the whole packed sequence, causally within each packed sample: keys and
values are all-gathered over the ring's process group (gloo) instead of passed around the ring, their gradients summed
over the ring's ranks in the backward pass. Everything around it (OpenRLHF's sequence split and gather, the ring
groups, MAPPA's routing of the same micro-batches to a ring's ranks) runs for real. The real package replaces flash
attention's forward; flash attention cannot load on CPU, so this one replaces sdpa's.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from openrlhf_mappa.patches.flash_attn_stub import all_gather  # flash-attn's, differentiable, over gloo

cu_seqlens = None  # of the whole packed micro-batch, set before each forward (update_ring_flash_attn_params)


def update_ring_flash_attn_params(cu_seqlens_N, process_group):
    global cu_seqlens
    cu_seqlens = cu_seqlens_N.cpu().long()


def substitute_hf_flash_attn(process_group, heads_k_stride):
    from transformers import AttentionInterface

    def ring_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        gather = lambda x_BHLD: all_gather(x_BHLD.transpose(0, 2), process_group).transpose(0, 2)  # ranks' L in order
        k_BHSD, v_BHSD = gather(key), gather(value)
        L, S = query.shape[2], k_BHSD.shape[2]
        pos_S = torch.arange(S)
        sample_S = torch.bucketize(pos_S, cu_seqlens[1:], right=True)  # which packed sample each token is in
        pos_L = pos_S[dist.get_rank(process_group) * L:][:L]
        mask_LS = (sample_S[pos_L, None] == sample_S[None, :]) & (pos_S[None, :] <= pos_L[:, None])
        heads = query.shape[1] // k_BHSD.shape[1]  # grouped-query attention
        out = F.scaled_dot_product_attention(query, k_BHSD.repeat_interleave(heads, 1), v_BHSD.repeat_interleave(heads, 1),
                                             attn_mask=mask_LS, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("sdpa", ring_attention)
