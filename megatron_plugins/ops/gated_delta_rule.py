"""Gated DeltaNet's kernels in plain torch, with flash-linear-attention's signatures.

megatron-core 0.19.2's ``GatedDeltaNet`` calls ``causal_conv1d``, ``l2norm`` and
``chunk_gated_delta_rule`` from flash-linear-attention (FLA), whose Triton kernels need a GPU.
These compute the same thing (fp32 inside, results in the input dtype, FLA's default scale
``1/sqrt(head_k_dim)``), differentiably, so the CPU simulation and GPUs without FLA run the same
layer; :mod:`megatron_plugins.compat.gated_delta_net` binds them into megatron-core.

Packed rows (``cu_seqlens``, batch 1) are laid out as one right-padded row per document: each
document's convolution and recurrent state start from zero (or its own initial state), and the
padding, which follows every real token, changes neither a document's outputs nor its state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_SIZE", "causal_conv1d", "chunk_gated_delta_rule", "l2norm"]

CHUNK_SIZE = 64
"""Tokens per chunk of the chunked delta rule (FLA's)."""

_ACTIVATIONS = (None, "silu", "swish")


def l2norm(x: torch.Tensor, eps: float = 1e-6,
           output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, in fp32, as FLA's ``l2norm``."""
    x32 = x.float()
    y = x32 * torch.rsqrt((x32 * x32).sum(dim=-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


class _Documents:
    """The documents of a batch as rows of a right-padded batch ``[N, T_max, ...]``.

    Without ``cu_seqlens`` every row of ``[B, T, ...]`` is one document and nothing moves; with
    them (batch 1) document ``n`` is tokens ``cu_seqlens[n]:cu_seqlens[n+1]``.
    """

    def __init__(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> None:
        self.packed = cu_seqlens is not None
        if not self.packed:
            self.lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long,
                                      device=x.device)
            return
        if x.shape[0] != 1:
            raise ValueError(f"packed inputs (cu_seqlens given) need batch size 1, not "
                             f"{x.shape[0]}; flatten the documents into one row")
        bounds = cu_seqlens.to(device=x.device, dtype=torch.long)
        if bounds[0] != 0 or bounds[-1] != x.shape[1] or (bounds.diff() < 0).any():
            raise ValueError(f"cu_seqlens {bounds.tolist()} must rise from 0 to the row's "
                             f"length {x.shape[1]}")
        self.lengths = bounds.diff()
        t_max = int(self.lengths.max()) if len(self.lengths) else 0
        offsets = torch.arange(t_max, device=x.device)
        self._valid = offsets < self.lengths[:, None]  # [N, T_max]
        self._gather = (bounds[:-1, None] + offsets).clamp(max=max(x.shape[1] - 1, 0))

    def batch(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, ...]`` as ``[N, T_max, ...]``, zeros after each document's end."""
        if not self.packed:
            return x
        rows = x[0][self._gather]
        mask = self._valid.reshape(*self._valid.shape, *[1] * (rows.dim() - 2))
        return rows * mask

    def unbatch(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`batch`: ``[N, T_max, ...]`` back to ``[B, T, ...]``."""
        if not self.packed:
            return rows
        return rows[self._valid][None]


def _check_initial_state(state: torch.Tensor | None, count: int, name: str) -> None:
    if state is not None and state.shape[0] != count:
        raise ValueError(f"{name} holds {state.shape[0]} states for {count} sequences")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's depthwise causal convolution: ``x`` ``[B, T, D]``, ``weight`` ``[D, W]``.

    ``y[t] = act(bias + sum_w weight[:, w] * x[t + w - W + 1])``, with the ``W`` inputs before a
    sequence taken from ``initial_state`` ``[N, D, W]`` (time-ordered, zeros without one). The
    final state ``[N, D, W]`` holds each sequence's last ``W`` inputs. Returns ``(y, state)``.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d activation {activation!r} is not one of {_ACTIVATIONS}")
    documents = _Documents(x, cu_seqlens)
    rows = documents.batch(x).float()  # [N, T, D]
    count, width = rows.shape[0], weight.shape[-1]
    _check_initial_state(initial_state, count, "causal_conv1d initial_state")
    history = (rows.new_zeros(count, width, rows.shape[-1]) if initial_state is None
               else initial_state.float().transpose(1, 2))
    extended = torch.cat([history, rows], dim=1)  # [N, W + T, D]
    y = F.conv1d(extended[:, 1:].transpose(1, 2), weight.float()[:, None],
                 None if bias is None else bias.float(), groups=rows.shape[-1]).transpose(1, 2)
    if activation is not None:
        y = F.silu(y)
    final_state = None
    if output_final_state:
        last = documents.lengths[:, None] + torch.arange(width, device=x.device)
        final_state = extended.gather(1, last[..., None].expand(-1, -1, rows.shape[-1]))
        final_state = final_state.transpose(1, 2).to(x.dtype)
    return documents.unbatch(y).to(x.dtype), final_state


def _chunked(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[N, H, T, ...]`` zero-padded to whole chunks, as ``[N, H, T / C, C, ...]``."""
    pad = -x.shape[2] % chunk_size
    padding = [0, 0] * (x.dim() - 3) + [0, pad]
    x = F.pad(x, padding)
    return x.reshape(*x.shape[:2], -1, chunk_size, *x.shape[3:])


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor,
                chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY) gated delta rule on fp32 ``[N, H, T, ...]`` tensors from ``state``
    ``[N, H, K, V]``: within a chunk the delta updates are solved at once (a unit lower
    triangular system), across chunks the state is carried. Returns ``(o, final state)``."""
    length = q.shape[2]
    q, k, v = (_chunked(t, chunk_size) for t in (q, k, v))
    g, beta = (_chunked(t, chunk_size) for t in (g, beta))  # [N, H, C#, C]; padding: g=beta=0
    decay = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(decay_i - decay_j) for j <= i: the decay between positions j and i of a chunk.
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf"))
    pairwise = pairwise.exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    system = system.tril(-1) + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                      unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                      unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pairwise
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    outputs = []
    for i in range(q.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :length]
    return o, state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's gated delta rule: ``q``, ``k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]``, ``g``
    (log decay) and ``beta`` ``[B, T, HV]``; ``HV`` a multiple of ``H`` (each q/k head serves
    ``HV / H`` consecutive value heads).

    Per token: ``S = S * exp(g)``, ``S += k (beta (v - S^T k))^T``, ``o = S^T q * scale``
    (``scale`` defaults to ``1/sqrt(K)``). ``initial_state`` and the final state (fp32) are
    ``[N, HV, K, V]``, one per sequence. Returns ``(o, final state or None)``, ``o`` in
    ``q``'s dtype.
    """
    if v.shape[2] % q.shape[2]:
        raise ValueError(f"chunk_gated_delta_rule: {v.shape[2]} value heads are not a multiple "
                         f"of {q.shape[2]} query/key heads")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    documents = _Documents(q, cu_seqlens)
    repeat = v.shape[2] // q.shape[2]
    q, k = (t.repeat_interleave(repeat, dim=2) if repeat > 1 else t for t in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q, output_dtype=torch.float32), l2norm(k, output_dtype=torch.float32)
    # [N, H, T, ...] in fp32
    heads_first = [documents.batch(t).float().transpose(1, 2) for t in (q, k, v, g, beta)]
    rows_q, rows_k, rows_v, rows_g, rows_beta = heads_first
    count, heads, _, key_dim = rows_k.shape
    _check_initial_state(initial_state, count, "chunk_gated_delta_rule initial_state")
    state = (rows_v.new_zeros(count, heads, key_dim, rows_v.shape[-1]) if initial_state is None
             else initial_state.float())
    o, state = _delta_rule(rows_q * scale, rows_k, rows_v, rows_g, rows_beta, state,
                           CHUNK_SIZE)
    o = documents.unbatch(o.transpose(1, 2)).to(q.dtype)
    return o, state if output_final_state else None
