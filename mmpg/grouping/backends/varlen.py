"""Varlen attention kernels behind one small interface, and the `flash` backend's grouped attention built on them.

A kernel computes attention over concatenated segments (FlashAttention's varlen convention):
    forward(q [Tq, Hq, D], k [Tk, Hkv, D], v, cu_q, cu_k, max_q, max_k, causal, scale)
        -> (out [Tq, Hq, D], lse [Hq, Tq])
    backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale) -> (dq, dk, dv)
Segment i of q attends to segment i of k; `lse` is float32 log-sum-exp of the scaled scores per query and head.

`FlashVarlenKernel` calls flash-attn's varlen functions (GPU; on the CPU through the tests' stand-in package). It is
built once per process and `deterministic` flag (`flash_kernel`), and the arguments the installed flash-attn takes are
read once per function: neither the version probe nor `inspect.signature` runs per call and layer. `deterministic`
is passed to flash-attn's backward (`model.deterministic`, set through `apply_grouped_attention`): its default
backward adds dK/dV partial sums in an order that varies from run to run; deterministic=True fixes the order, at
some cost in backward speed (flash-attn's own figure: it uses more memory and can be slower).
`TorchVarlenKernel` is a pure-torch kernel with the same contract; it lets the merge (`mmpg.grouping.merge`) and the
custom backward be tested exactly on a CPU (backend `lse_reference`).
"""

from __future__ import annotations

import functools
import inspect

import torch

from mmpg.grouping.backends import probe
from mmpg.grouping.backends.probe import flash_interface
from mmpg.grouping.merge import merge_attention


class TorchVarlenKernel:
    """Reference kernel: per segment dense scores in float32. Slow, exact, CPU and GPU. GQA by head groups."""

    @staticmethod
    def _segments(cu_q, cu_k):
        return zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())

    @staticmethod
    def _acc(x):
        """Accumulation dtype: float32, or float64 for float64 inputs (tests compare against dense attention)."""
        return torch.promote_types(x.dtype, torch.float32)

    @staticmethod
    def _probs(qs, ks, causal, scale, lse=None):
        # qs [Hq, Sq, D], ks [Hq, Sk, D] -> scores [Hq, Sq, Sk] (causal aligned bottom-right, as FlashAttention)
        acc = TorchVarlenKernel._acc(qs)
        s = torch.einsum("hqd,hkd->hqk", qs.to(acc), ks.to(acc)) * scale
        if causal:
            sq, sk = s.shape[1], s.shape[2]
            keep = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq)
            s = s.masked_fill(~keep, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)  # [Hq, Sq]
        return torch.exp(s - lse[..., None]), lse

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        rep = q.shape[1] // k.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=self._acc(q), device=q.device)
        for a, b, c, d in self._segments(cu_q, cu_k):
            qs = q[a:b].transpose(0, 1)
            ks = k[c:d].repeat_interleave(rep, dim=1).transpose(0, 1)
            vs = v[c:d].repeat_interleave(rep, dim=1).transpose(0, 1)
            p, seg_lse = self._probs(qs, ks, causal, scale)
            out[a:b] = torch.einsum("hqk,hkd->hqd", p, vs.to(p.dtype)).transpose(0, 1).to(q.dtype)
            lse[:, a:b] = seg_lse
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        rep, acc = q.shape[1] // k.shape[1], self._acc(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for a, b, c, d in self._segments(cu_q, cu_k):
            qs = q[a:b].transpose(0, 1).to(acc)
            ks = k[c:d].repeat_interleave(rep, dim=1).transpose(0, 1).to(acc)
            vs = v[c:d].repeat_interleave(rep, dim=1).transpose(0, 1).to(acc)
            do = dout[a:b].transpose(0, 1).to(acc)
            o = out[a:b].transpose(0, 1).to(acc)
            p, _ = self._probs(qs, ks, causal, scale, lse=lse[:, a:b])
            # Softmax backward with the (possibly merged) output: dS = P * (dO V^T - rowsum(dO * O)).
            ds = p * (torch.einsum("hqd,hkd->hqk", do, vs) - (do * o).sum(-1, keepdim=True))
            dq[a:b] = (torch.einsum("hqk,hkd->hqd", ds, ks) * scale).transpose(0, 1)
            dks = torch.einsum("hqk,hqd->hkd", ds, qs) * scale
            dvs = torch.einsum("hqk,hqd->hkd", p, do)
            hk = k.shape[1]
            dk[c:d] += dks.view(hk, rep, -1, dks.shape[-1]).sum(1).transpose(0, 1)
            dv[c:d] += dvs.view(hk, rep, -1, dvs.shape[-1]).sum(1).transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@functools.cache
def _parameters(fn) -> frozenset[str]:
    """The argument names `fn` takes (read once per function). From flash-attn 2.6 on, with torch >= 2.4, the
    functions are `torch.library.custom_op`s whose own signature is (*args, **kwargs): the wrapped function
    (`_init_fn`) has the real one."""
    return frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _call_with_supported(fn, **kwargs):
    """flash-attn added arguments across 2.x releases (softcap, ...); pass only the ones this version takes."""
    params = _parameters(fn)
    return fn(**{name: value for name, value in kwargs.items() if name in params})


class FlashVarlenKernel:
    """flash-attn 2 (>= 2.7) varlen forward/backward: CUDA, fp16/bf16, head size a multiple of 8 up to 256. On the CPU
    its call sites run through the stand-in package in tests/fake_flash_attn (tests/test_flash_standin.py); the real
    kernel only in the `gpu` tests."""

    def __init__(self, deterministic: bool = False):
        self._fwd, self._bwd = flash_interface()  # ImportError naming the problem (version, FA4-only, missing)
        self.deterministic = bool(deterministic)

    @staticmethod
    def _explain(err: RuntimeError, q) -> RuntimeError:
        return RuntimeError(
            f"flash-attn refused the grouped attention call: {err}. q/k/v were {q.dtype}, head size {q.shape[-1]}, on "
            f"{q.device}; the flash backend needs fp16/bf16 on CUDA (load the model in bf16 or run under "
            "torch.autocast) and a head size that is a multiple of 8 up to 256, else use backend='sdpa'")

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        try:
            res = _call_with_supported(
                self._fwd, q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0, softmax_scale=scale,
                causal=causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                return_softmax=False)
        except RuntimeError as err:
            raise self._explain(err, q) from err
        return res[0], res[1]  # out [Tq, Hq, D], lse float32 [Hq, Tq]

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call_with_supported(
            self._bwd, dout=dout.contiguous(), q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
            out=out.contiguous(), softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0, softmax_scale=scale,
            causal=causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
            deterministic=self.deterministic, rng_state=None)
        return dq, dk, dv


class GroupedVarlenAttention(torch.autograd.Function):
    """Grouped attention from three varlen kernel calls, no G-fold K/V copy (the ring-attention pattern):

        prefix tokens:   q_pre -> k_pre, causal per prefix                       (o_p, lse_p)
        response tokens: q_resp -> k_pre of its group, full        (o_a, lse_a) \\ merged by LSE into (o_r, lse_r)
                         q_resp -> k_resp of its own response, causal (o_b, lse_b) /
    Backward runs the kernel's backward on each part with the merged (o_r, lse_r): with the global LSE each part's
    probabilities are the true softmax of the union, so the per-part gradients add up to the exact gradient.
    """

    @staticmethod
    def forward(ctx, q, k, v, layout, kernel, scale):
        # q [T, Hq, D], k/v [T, Hkv, D] in packed-row order
        pi, ri = layout.prefix_index, layout.response_index
        cu_p, mp = layout.cu_seqlens("prefix")
        cu_g, mg = layout.cu_seqlens("group_responses")
        cu_r, mr = layout.cu_seqlens("response")
        qp, kp, vp, qr, kr, vr = q[pi], k[pi], v[pi], q[ri], k[ri], v[ri]
        o_p, lse_p = kernel.forward(qp, kp, vp, cu_p, cu_p, mp, mp, True, scale)
        o_a, lse_a = kernel.forward(qr, kp, vp, cu_g, cu_p, mg, mp, False, scale)
        o_b, lse_b = kernel.forward(qr, kr, vr, cu_r, cu_r, mr, mr, True, scale)
        o_r, lse_r = merge_attention([(o_a, lse_a.t()), (o_b, lse_b.t())])  # lse [Hq, Tr] seen as [Tr, Hq]
        lse_r = lse_r.t()  # [Hq, Tr], contiguous again (the merge keeps its inputs' memory layout)
        out = q.new_empty(q.shape)
        out[pi], out[ri] = o_p, o_r
        ctx.save_for_backward(q, k, v, o_p, lse_p, o_r, lse_r)
        ctx.layout, ctx.kernel, ctx.scale = layout, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o_p, lse_p, o_r, lse_r = ctx.saved_tensors
        layout, kernel, scale = ctx.layout, ctx.kernel, ctx.scale
        pi, ri = layout.prefix_index, layout.response_index
        cu_p, mp = layout.cu_seqlens("prefix")
        cu_g, mg = layout.cu_seqlens("group_responses")
        cu_r, mr = layout.cu_seqlens("response")
        qp, kp, vp, qr, kr, vr = q[pi], k[pi], v[pi], q[ri], k[ri], v[ri]
        do_p, do_r = dout[pi], dout[ri]
        dq_p, dk_p, dv_p = kernel.backward(do_p, qp, kp, vp, o_p, lse_p, cu_p, cu_p, mp, mp, True, scale)
        dq_a, dk_a, dv_a = kernel.backward(do_r, qr, kp, vp, o_r, lse_r, cu_g, cu_p, mg, mp, False, scale)
        dq_b, dk_b, dv_b = kernel.backward(do_r, qr, kr, vr, o_r, lse_r, cu_r, cu_r, mr, mr, True, scale)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dq[pi], dq[ri] = dq_p, dq_a + dq_b
        dk[pi], dk[ri] = dk_p + dk_a, dk_b
        dv[pi], dv[ri] = dv_p + dv_a, dv_b
        return dq, dk, dv, None, None, None


def varlen_grouped_attention(query, key, value, layout, scaling, kernel) -> torch.Tensor:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D]."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    out = GroupedVarlenAttention.apply(q, k, v, layout, kernel, scaling)
    return out[None]


@functools.cache
def flash_kernel(deterministic: bool = False) -> FlashVarlenKernel:
    """The process's flash kernel for this `deterministic` flag (`probe.reset` clears it with the probe's cache)."""
    return FlashVarlenKernel(deterministic)


probe._ON_RESET.extend([flash_kernel.cache_clear, _parameters.cache_clear])


def flash_grouped_attention(query, key, value, layout, scaling):
    kernel = flash_kernel(bool(getattr(layout, "deterministic", False)))
    return varlen_grouped_attention(query, key, value, layout, scaling, kernel)


def reference_grouped_attention(query, key, value, layout, scaling):
    """The `flash` algorithm with the pure-torch stand-in kernel (backend name `lse_reference`, for tests)."""
    return varlen_grouped_attention(query, key, value, layout, scaling, TorchVarlenKernel())
