"""The Fisher kernel K = S S^T without S: a seeded sketch of every per-sequence score, layer by layer.

Rung 2 needs only the n x n kernel K_ij = <s_i, s_j> of the per-sequence scores
s_i = grad_theta log pi(y_i | x_i), never S itself (n x |theta|: 224 GB for 8 rollouts of a
7B policy). This module computes an unbiased estimate K~ in one batched forward and backward
pass, with memory O(n * (m + one layer's sketch)) beyond the pass itself, in the style of
LoGra (Choe et al., 2024). Two stages, every projection regenerated from (seed, parameter
name), never stored or sent:

1. **Per parameter, a first sketch** of the per-sequence gradient, of at most r^2 entries:

   * A weight matrix W (a x b) of a ``Linear`` (a = out, b = in) has per-sequence gradient
     G_i = sum_t u_it v_it^T, u the output gradient and v the input. Seeded Gaussian
     projections P (r x a) and Q (r x b), entries N(0, 1/r), are applied to the two sides
     *before* the outer product: P G_i Q^T = sum_t (P u_it)(Q v_it)^T, so G_i is never
     formed. E[P^T P] = I, E[Q^T Q] = I, P and Q independent, hence
     E <P G_i Q^T, P G_j Q^T> = <G_i, G_j>. A side of size <= r is not projected. An embedding
     tied to a Linear (a shared output layer) is sketched the same way (its rows are the
     one-hot tokens) and its two uses summed before any inner product, as the gradients are.
   * An untied ``Embedding`` (V x d) gets a dense JL projection of its flattened gradient:
     sum_t D_{y_t} R g_t, with R (r^2 x d) Gaussian and D_y a diagonal of signs hashed from
     (seed, token). The implied r^2 x (V d) matrix [D_1 R, ..., D_V R] is dense, and
     E[R^T D_v D_w R] = 0 for v != w, so different tokens do not leak into each other (a
     Kronecker projection of the one-hot side would: <P e_v, P e_w> ~ 1/sqrt(r)).
   * Every other parameter (norm scales, biases: ~0.1 % of a transformer's) is taken per
     sequence exactly, by substituting a per-sequence copy for the one forward (shape
     (n, 1, ..., *shape), broadcast like the original) -- a Linear's bias is summed from its
     output gradient -- and then projected densely to r^2 entries when longer. A module
     whose computation does not broadcast that way (``nn.LayerNorm``'s fused kernel, for
     one) is refused by name.

2. **Down to the sketch dimension m**: the parameters' first sketches together have D
   entries; when D > m, each parameter's first sketch (d_p entries) is projected by a
   seeded Gaussian (d_p x m_p, N(0, 1/m_p)) to m_p entries, m_p proportional to its share
   of tr(K~) (a JL estimate's variance goes as the square of the share over m_p, so this
   allocation minimises the total), at least 1 and at most d_p. Conditionally on the first
   stage the second is unbiased, so K~ stays unbiased.

Across processes (parameters split over ranks), K~ is a sum over parameters: each rank
sketches the parameters assigned to it (a fixed round-robin over names, the same on every
rank), one all_reduce of each parameter's trace share sets the allocation, and one
``all_reduce`` of the n x n matrix completes K~. The result does not depend on the number of
processes, since the projections depend on the seed and the parameter's name only.

Two sketches with different seeds are independent estimates of K; ``metric_g`` compares the
KL_min they give (``kernel_check=``) and folds their disagreement into ``damping_stable``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from reward_lens.measure.whitebox.policy import Sequences, WhiteboxError


@dataclass(frozen=True)
class SketchedKernel:
    """An estimate of K = S S^T (n x n, float64) from a seeded sketch of dimension ``dim``."""

    kernel: np.ndarray
    dim: int  # m: entries of each sequence's sketch
    seed: int
    rank: int  # r: the first stage's size per side
    n_parameters: int
    n_exact: int  # entries that are exact gradient coordinates (no projection at either stage)
    matrices: int  # weight matrices sketched
    first_stage: int  # D: the first stage's entries, before the reduction to m


def _projection(seed: int, name: str, side: str, r: int, size: int, *, force: bool = False) -> torch.Tensor | None:
    """N(0, 1/r) entries, r x size, regenerated from (seed, name, side); None = identity
    (when size <= r, unless ``force``)."""
    if size <= r and not force:
        return None
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"{name}/{side}".encode())) % (1 << 62))
    return torch.randn(r, size, generator=g, dtype=torch.float32) / float(np.sqrt(r))


def _signs(seed: int, name: str, tokens: torch.Tensor, width: int) -> torch.Tensor:
    """+-1 of shape tokens.shape + (width,), a hash of (seed, name, token, column): the
    diagonal D_token of the dense embedding projection, regenerated for the tokens present."""
    salt = (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 31)
    x = tokens.long()[..., None] * 1_000_003 + torch.arange(width, dtype=torch.long) * 7919 + salt
    x = (x ^ (x >> 16)) * 0x45D9F3B % (1 << 32)  # integer mixing (a murmur-style finaliser)
    x = (x ^ (x >> 16)) * 0x45D9F3B % (1 << 32)
    x = x ^ (x >> 16)
    return (x & 1).float() * 2 - 1


def _allocate(params: dict[str, tuple[int, float]], dim: int) -> dict[str, int]:
    """m_p proportional to the trace share, at least 1, at most the width d_p; what a capped
    parameter does not use goes to the others (water-filling). Sums to about ``dim``."""
    if sum(w for w, _ in params.values()) <= dim:
        return {nm: w for nm, (w, _) in params.items()}
    alloc: dict[str, int] = {}
    left, active = dim, dict(params)
    while active:
        total = sum(t for _, t in active.values())
        capped = {nm for nm, (w, t) in active.items() if total > 0 and left * t / total >= w}
        if not capped:
            for nm, (w, t) in active.items():
                alloc[nm] = min(w, max(1, round(left * t / total))) if total > 0 else 1
            break
        for nm in capped:
            alloc[nm] = active.pop(nm)[0]
            left -= alloc[nm]
    return alloc


def _owned(names: list[str], group) -> set[str]:
    if group is None:
        return set(names)
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return {nm for k, nm in enumerate(sorted(names)) if k % world == rank}


def sketched_kernel(model, seqs: Sequences, *, dim: int = 16384, rank: int = 64, seed: int = 0,
                    group=None) -> SketchedKernel:
    """K~ for the sequences ``seqs`` at the policy ``model`` (see the module docstring).

    ``dim`` is m, the entries of each sequence's sketch; ``rank`` is r, the first stage's
    size per side of each weight matrix; ``group`` a torch.distributed process group over
    which the parameters are split and K~ summed.
    """
    if rank < 1 or dim < 1:
        raise WhiteboxError(f"sketch rank and dimension must be >= 1, not {rank} and {dim}")
    n = seqs.n
    if n < 2:
        raise WhiteboxError(f"the Fisher kernel needs at least 2 sequences, not {n}")
    name_of = {}  # id(parameter) -> its first name (tied parameters appear once)
    for nm, p in model.named_parameters():
        if p.requires_grad:
            name_of.setdefault(id(p), nm)
    by_name = {nm: p for nm, p in model.named_parameters() if name_of.get(id(p)) == nm}
    owned = _owned(list(by_name), group)
    # weight matrices: name -> [(module, kind)]; a Linear's bias is taken exactly by its hook
    uses: dict[str, list[tuple[torch.nn.Module, str]]] = {}
    bias_of: dict[int, str] = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and id(w) in name_of:
            uses.setdefault(name_of[id(w)], []).append((mod, "linear" if isinstance(mod, torch.nn.Linear)
                                                        else "embedding"))
        b = getattr(mod, "bias", None) if isinstance(mod, torch.nn.Linear) else None
        if b is not None and id(b) in name_of:
            bias_of[id(mod)] = name_of[id(b)]
    exact = [nm for nm in by_name if nm not in uses and nm not in bias_of.values()]
    bad = [nm for nm in exact if by_name[nm].ndim > 1]
    if bad:
        raise WhiteboxError(f"parameter {bad[0]} (shape {tuple(by_name[bad[0]].shape)}) is neither a Linear's nor "
                            "an Embedding's weight: the sketch has no per-sequence form for it")
    holder: dict[str, tuple[torch.nn.Module, str]] = {}  # exact parameter -> (its module, attribute)
    for mod in model.modules():
        for attr, p in mod.named_parameters(recurse=False):
            nm = name_of.get(id(p))
            if nm in exact and nm in owned:
                holder.setdefault(nm, (mod, attr))

    tied = {nm for nm, mods in uses.items() if {k for _, k in mods} == {"linear", "embedding"}}
    proj = {}
    for nm in uses:
        if nm not in owned:
            continue
        a, b = by_name[nm].shape
        if nm in tied or all(k == "linear" for _, k in uses[nm]):
            proj[nm] = (_projection(seed, nm, "rows", rank, a), _projection(seed, nm, "cols", rank, b))
        else:  # an untied embedding: dense JL of the flattened gradient (exact when it is small)
            proj[nm] = (None, _projection(seed, nm, "embedding", rank * rank, b, force=True)
                        if a * b > rank * rank else None)
    parts: dict[str, list[torch.Tensor]] = {}  # name -> per-use (n, dims) per-sequence pieces (summed)
    copies: dict[str, list[torch.Tensor]] = {}  # exact parameter -> its per-sequence copies, one per call
    anchors: list[torch.Tensor] = []
    handles = []

    def side(p: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().reshape(n, -1, x.shape[-1])
        return x if p is None else x @ p.T

    def add(nm: str, piece: torch.Tensor) -> None:
        parts.setdefault(nm, []).append(piece.reshape(n, -1))

    def hook_linear(mod: torch.nn.Module, nm: str | None):
        pa, pb = proj.get(nm, (None, None))
        bias = bias_of.get(id(mod))
        bias = bias if bias in owned else None

        def fwd(m, inputs, output):
            x = side(pb, inputs[0]) if nm is not None else None
            anchors.append(output)

            def back(g):
                if nm is not None:
                    add(nm, torch.einsum("ntr,nts->nrs", side(pa, g).double(), x.double()))
                if bias is not None:
                    add(bias, g.detach().double().reshape(n, -1, g.shape[-1]).sum(1))
            output.register_hook(back)

        return mod.register_forward_hook(fwd)

    def hook_embedding(mod: torch.nn.Module, nm: str):
        pa, pb = proj[nm]
        dense = nm not in tied and pb is not None

        def fwd(m, inputs, output):
            ids = inputs[0].detach().reshape(n, -1)
            keep = (ids != m.padding_idx)[..., None].float() if m.padding_idx is not None else None
            anchors.append(output)
            if dense:
                d = _signs(seed, nm, ids, pb.shape[0])  # (n, T, r^2): D_token for each position
            else:
                u = torch.nn.functional.one_hot(ids, m.num_embeddings).float() if pa is None else pa.T[ids]

            def back(g):
                if dense:  # sum_t D_{y_t} R g_t
                    piece = (d * side(pb, g)) if keep is None else d * side(pb, g) * keep
                    add(nm, piece.double().sum(1))
                else:
                    add(nm, torch.einsum("ntr,nts->nrs", (u if keep is None else u * keep).double(),
                                         side(pb, g).double()))
            output.register_hook(back)

        return mod.register_forward_hook(fwd)

    def hook_exact(nm: str, mod: torch.nn.Module, attr: str):
        p = by_name[nm]

        def pre(m, inputs):
            x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
            lead = max(x.ndim - p.ndim - 1, 0) if x is not None else 0
            e = p.detach().reshape((1,) + (1,) * lead + tuple(p.shape)).repeat((n,) + (1,) * (lead + p.ndim))
            copies.setdefault(nm, []).append(e.requires_grad_(True))
            m._parameters[attr] = e  # bypasses Module.__setattr__'s Parameter check, for this forward only

        def post(m, inputs, output):
            m._parameters[attr] = p

        return [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    was_training = model.training
    model.eval()
    try:
        for nm, mods in uses.items():
            for mod, kind in mods:
                if kind == "embedding" and nm in owned:
                    handles.append(hook_embedding(mod, nm))
                elif kind == "linear" and (nm in owned or bias_of.get(id(mod)) in owned):
                    handles.append(hook_linear(mod, nm if nm in owned else None))
        for nm, (mod, attr) in holder.items():
            handles.extend(hook_exact(nm, mod, attr))
        start: list[torch.Tensor] = []
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if emb is not None:
            handles.append(emb.register_forward_hook(lambda m, i, o: start.append(o)))
        with torch.enable_grad():
            ids = seqs.ids
            logits = model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            total = (logp * seqs.completion_mask[:, 1:]).sum()
            leaves = [e for nm in copies for e in copies[nm]]
            # The gradient is asked of the per-sequence copies and of the input embeddings' output
            # (never of a weight: that would allocate |theta| floats); every hooked module's output
            # gradient is computed on the way there, and its hook fires. With frozen embeddings,
            # of every hooked output instead.
            first = [o for o in start if o.requires_grad][:1]
            wanted = leaves + (first or [a for a in anchors if a.requires_grad])
            grads = torch.autograd.grad(total, wanted, allow_unused=True) if wanted else ()
    except RuntimeError as exc:
        raise WhiteboxError(f"the sketch's forward and backward pass failed ({exc}); a module that computes with "
                            "a vector parameter in a way that does not broadcast over sequences (nn.LayerNorm's "
                            "fused kernel, for one) cannot be taken per sequence") from exc
    finally:
        for h in handles:
            h.remove()
        for nm, (mod, attr) in holder.items():
            mod._parameters[attr] = by_name[nm]
        model.train(was_training)

    # per parameter: its first-stage sketch, (n, d_p), float64, summed over the parameter's uses
    first = {nm: sum(ps) for nm, ps in parts.items()}
    g_iter = iter(grads)
    for nm in copies:
        gs = [g.detach().double().reshape(n, -1) for g in (next(g_iter) for _ in copies[nm]) if g is not None]
        if gs:
            first[nm] = sum(gs)
    exact: dict[str, bool] = {}  # whether the entries are gradient coordinates themselves
    for nm, phi in first.items():
        if nm in proj:
            exact[nm] = proj[nm] == (None, None)
        elif phi.shape[1] > rank * rank:  # a long vector parameter: dense JL to r^2
            first[nm] = phi @ _projection(seed, nm, "dense", rank * rank, phi.shape[1]).double().T
            exact[nm] = False
        else:
            exact[nm] = True

    # stage 2: allocate m over the parameters by their share of tr(K~), the same on every rank
    names = sorted(by_name)
    widths = torch.tensor([first[nm].shape[1] if nm in first else 0 for nm in names], dtype=torch.float64)
    traces = torch.tensor([float((first[nm] ** 2).sum()) if nm in first else 0.0 for nm in names],
                          dtype=torch.float64)
    if group is not None:
        import torch.distributed as dist

        both = torch.stack([widths, traces])
        dist.all_reduce(both, group=group)
        widths, traces = both[0], both[1]
    total_width = int(widths.sum())
    k = np.zeros((n, n), dtype=np.float64)
    m = n_exact = 0
    alloc = _allocate({nm: (int(widths[i]), float(traces[i])) for i, nm in enumerate(names) if widths[i] > 0}, dim)
    for nm, phi in first.items():
        if alloc[nm] < phi.shape[1]:
            phi = phi @ _projection(seed, nm, "reduce", alloc[nm], phi.shape[1]).double().T
        elif exact[nm]:
            n_exact += phi.shape[1]
        k += (phi @ phi.T).numpy()
        m += phi.shape[1]
    if group is not None:
        import torch.distributed as dist

        kt = torch.from_numpy(k)
        dist.all_reduce(kt, group=group)
        counts = torch.tensor([m, n_exact], dtype=torch.float64)
        dist.all_reduce(counts, group=group)
        k, m, n_exact = kt.numpy(), int(counts[0]), int(counts[1])
    if not np.isfinite(k).all():
        raise WhiteboxError("the sketched kernel has non-finite entries: the policy's log-probabilities overflowed")
    return SketchedKernel(kernel=k, dim=m, seed=seed, rank=rank,
                          n_parameters=sum(p.numel() for p in by_name.values()), n_exact=n_exact, matrices=len(uses),
                          first_stage=total_width)
