"""Plain-torch reference of the sparse MLA contract (forward and closed-form backward).

Every backend is checked against these functions. They compute in ``compute_dtype``
(float64 by default), work on CPU and CUDA tensors, and process the query rows in chunks so
that the gathered KV rows of one chunk stay small (S_q=4096, K=2048, H=128 fits).

Contract (inputs flattened over the batch, indices global into ``kv``):
slot j of row t is valid iff ``0 <= idx < S_kv`` and, with ``topk_length``, ``j <
clamp(topk_length[t], 0, K)``. Each valid slot is its own softmax term (duplicates count
once per slot). ``lse`` excludes the sink and is ``+inf`` for a row without valid slots;
``out = sum_j p_j v_j`` with ``p_j = exp(s_j - logaddexp(lse, sink))``. Out-of-range indices
are never used to index: they are clamped to row 0 and masked.
"""

from __future__ import annotations

import torch

#: Elements (of ``compute_dtype``) one chunk of query rows may allocate, roughly.
_CHUNK_ELEMENTS = 1 << 26


def valid_mask(topk_idxs: torch.Tensor, s_kv: int, topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[S_q, K]``: which top-k slots take part in the softmax."""
    idx = topk_idxs.long()
    mask = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        k = topk_idxs.shape[1]
        length = topk_length.long().clamp(0, k)
        cols = torch.arange(k, device=topk_idxs.device)
        mask &= cols[None, :] < length[:, None]
    return mask


def _chunk_rows(heads: int, k: int, d_qk: int) -> int:
    per_row = 3 * k * d_qk + 4 * heads * k + 1
    return max(1, _CHUNK_ELEMENTS // per_row)


def _sink_weight(lse: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """``exp(lse - logaddexp(lse, sink)) = 1/(1+exp(sink-lse))``, finite for every legal input.

    Rows with ``lse = +inf`` (no valid slot) get 0; their probabilities are all zero anyway.
    """
    if sink is None:
        return torch.where(torch.isinf(lse), torch.zeros_like(lse), torch.ones_like(lse))
    empty = torch.isinf(lse)
    safe_lse = torch.where(empty, torch.zeros_like(lse), lse)
    w = torch.sigmoid(safe_lse - sink[None, :])  # sink=+inf -> 0, -inf -> 1, no inf-inf
    return torch.where(empty, torch.zeros_like(w), w)


def _sink_prob(lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``p_sink = exp(sink - logaddexp(lse, sink))`` with the contract's values at the edges.

    ``sink=+inf`` gives 1; ``sink=-inf`` gives 0; an empty row (``lse=+inf``) gives 0 for a
    finite sink and 1 for ``sink=+inf``.
    """
    sink_b = sink[None, :].expand_as(lse)
    empty = torch.isinf(lse)
    safe_lse = torch.where(empty, torch.zeros_like(lse), lse)
    p = torch.sigmoid(sink_b - safe_lse)
    pos_inf_sink = torch.isposinf(sink_b)
    empty_val = torch.where(pos_inf_sink, torch.ones_like(p), torch.zeros_like(p))
    return torch.where(empty, empty_val, p)


def _prepare(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor,
             topk_length: torch.Tensor | None, softmax_scale: float | None, d_v: int,
             compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    if q.dim() != 3 or kv.dim() != 2 or topk_idxs.dim() != 2:
        raise ValueError(f"expected q [S_q,H,D], kv [S_kv,D], topk_idxs [S_q,K]; got "
                         f"{tuple(q.shape)}, {tuple(kv.shape)}, {tuple(topk_idxs.shape)}")
    d_qk = q.shape[2]
    if kv.shape[1] != d_qk or topk_idxs.shape[0] != q.shape[0] or d_v > d_qk:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                         f"topk_idxs {tuple(topk_idxs.shape)}, d_v={d_v}")
    scale = float(d_qk ** -0.5) if softmax_scale is None else float(softmax_scale)
    mask = valid_mask(topk_idxs, kv.shape[0], topk_length)
    # Never index with an out-of-range value: clamp to row 0, the mask removes the slot.
    safe_idx = torch.where(mask, topk_idxs.long(), torch.zeros_like(topk_idxs, dtype=torch.long))
    return mask, safe_idx, scale


def _kv_rows(kv: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """kv in ``compute_dtype`` with at least one row, so a clamped index 0 is always in bounds."""
    kvc = kv.to(compute_dtype)
    if kvc.shape[0] == 0:
        kvc = torch.zeros(1, kv.shape[1], dtype=compute_dtype, device=kv.device)
    return kvc


def _scores(qc: torch.Tensor, krows: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled scores ``[c, H, K]`` with invalid slots at -inf (set before any exp)."""
    s = torch.einsum("thd,tkd->thk", qc, krows) * scale
    return s.masked_fill(~mask[:, None, :], float("-inf"))


def _row_lse(s: torch.Tensor) -> torch.Tensor:
    """Natural-log logsumexp over the last dim; +inf where every entry is -inf."""
    if s.shape[-1] == 0:
        return torch.full(s.shape[:-1], float("inf"), dtype=s.dtype, device=s.device)
    m = s.amax(dim=-1)
    empty = torch.isneginf(m)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    lse = m_safe + torch.log(torch.exp(s - m_safe[..., None]).sum(dim=-1))
    return torch.where(empty, torch.full_like(lse, float("inf")), lse)


def sparse_mla_fwd_ref(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor,
                       topk_length: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None,
                       softmax_scale: float | None = None, d_v: int = 512,
                       compute_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the contract: ``(out [S_q,H,d_v], lse [S_q,H])``, both in ``compute_dtype``.

    ``lse`` excludes the sink and is ``+inf`` for rows without a valid slot (their ``out`` is 0).
    """
    mask, safe_idx, scale = _prepare(q, kv, topk_idxs, topk_length, softmax_scale, d_v, compute_dtype)
    s_q, heads, d_qk = q.shape
    k = topk_idxs.shape[1]
    kvc = _kv_rows(kv, compute_dtype)
    sink = None if attn_sink is None else attn_sink.to(compute_dtype)
    out = torch.zeros(s_q, heads, d_v, dtype=compute_dtype, device=q.device)
    lse = torch.full((s_q, heads), float("inf"), dtype=compute_dtype, device=q.device)
    step = _chunk_rows(heads, k, d_qk)
    for t0 in range(0, s_q, step):
        t1 = min(s_q, t0 + step)
        qc = q[t0:t1].to(compute_dtype)
        rows = kvc[safe_idx[t0:t1]]                     # [c, K, D_qk]
        s = _scores(qc, rows, mask[t0:t1], scale)
        lse_c = _row_lse(s)
        # exp(s - lse): masked slots are exp(-inf)=0; empty rows have lse=+inf -> exp(-inf)=0.
        p = torch.exp(s - lse_c[..., None]) * _sink_weight(lse_c, sink)[..., None]
        out[t0:t1] = torch.einsum("thk,tkd->thd", p, rows[..., :d_v])
        lse[t0:t1] = lse_c
    return out, lse


def sparse_mla_bwd_ref(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                       lse: torch.Tensor, topk_idxs: torch.Tensor, topk_length: torch.Tensor | None = None,
                       attn_sink: torch.Tensor | None = None, softmax_scale: float | None = None,
                       d_v: int = 512, compute_dtype: torch.dtype = torch.float64,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Closed-form backward: ``(dq [S_q,H,D_qk], dkv [S_kv,D_qk], d_sink [H] or None)``.

    Uses ``out`` and ``lse`` as given (``delta = rowsum(out*dout)``), as the kernels do.
    """
    mask, safe_idx, scale = _prepare(q, kv, topk_idxs, topk_length, softmax_scale, d_v, compute_dtype)
    s_q, heads, d_qk = q.shape
    s_kv = kv.shape[0]
    k = topk_idxs.shape[1]
    kvc = _kv_rows(kv, compute_dtype)
    sink = None if attn_sink is None else attn_sink.to(compute_dtype)
    lse_c_all = lse.to(compute_dtype)
    delta = (out.to(compute_dtype) * dout.to(compute_dtype)).sum(dim=-1)   # [S_q, H]
    dq = torch.zeros(s_q, heads, d_qk, dtype=compute_dtype, device=q.device)
    dkv = torch.zeros(max(s_kv, 1), d_qk, dtype=compute_dtype, device=q.device)
    step = _chunk_rows(heads, k, d_qk)
    for t0 in range(0, s_q, step):
        t1 = min(s_q, t0 + step)
        qc = q[t0:t1].to(compute_dtype)
        doc = dout[t0:t1].to(compute_dtype)
        rows = kvc[safe_idx[t0:t1]]
        m = mask[t0:t1]
        s = _scores(qc, rows, m, scale)
        lse_c = lse_c_all[t0:t1]
        p = torch.exp(s - lse_c[..., None]) * _sink_weight(lse_c, sink)[..., None]   # [c, H, K]
        dp = torch.einsum("thd,tkd->thk", doc, rows[..., :d_v])
        ds = p * (dp - delta[t0:t1, :, None])
        ds = ds.masked_fill(~m[:, None, :], 0.0)
        dq[t0:t1] = scale * torch.einsum("thk,tkd->thd", ds, rows)
        contrib = scale * torch.einsum("thk,thd->tkd", ds, qc)                # [c, K, D_qk]
        contrib[..., :d_v] += torch.einsum("thk,thd->tkd", p, doc)
        contrib = contrib.masked_fill(~m[..., None], 0.0)
        sel = m.reshape(-1)
        dkv.index_add_(0, safe_idx[t0:t1].reshape(-1)[sel], contrib.reshape(-1, d_qk)[sel])
    dkv = dkv[:s_kv]
    d_sink = None
    if sink is not None:
        d_sink = -(_sink_prob(lse_c_all, sink) * delta).sum(dim=0)
    return dq, dkv, d_sink
