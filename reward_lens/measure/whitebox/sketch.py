"""The Fisher kernel K = S S^T without S: a seeded sketch of every per-sequence score, layer by layer.

Rung 2 needs only the n x n kernel K_ij = <s_i, s_j> of the per-sequence scores
s_i = grad_theta log pi(y_i | x_i), never S itself (n x |theta|: 224 GB for 8 rollouts of a
7B policy). This module computes an unbiased estimate K~ in one batched forward and backward
pass, with memory O(n * m + the largest layer), in the style of LoGra (Choe et al., 2024):

* **A weight matrix** W (a x b) -- of a ``Linear`` (a = out, b = in) or an ``Embedding``
  (a = vocabulary, b = width) -- has per-sequence gradient G_i = sum_t u_it v_it^T, with
  (u, v) = (output gradient, input) for a Linear and (output gradient, one-hot token) for an
  Embedding (in W's layout: rows indexed by the token). Two seeded Gaussian projections
  P (r_a x a) and Q (r_b x b), entries N(0, 1/r), are applied to the two sides *before* the
  outer product: P G_i Q^T = sum_t (P u_it)(Q v_it)^T, an r_a x r_b matrix, so G_i is never
  formed. E[P^T P] = I and E[Q^T Q] = I with P, Q independent, so
  E <P G_i Q^T, P G_j Q^T> = <G_i, G_j>: each layer's contribution to K is unbiased. A side of
  size <= r is not projected (identity: exact). The projections are regenerated from
  (seed, parameter name), never stored or sent. Tied weights (an embedding shared with the
  output layer) get one pair of projections and their two contributions are summed before
  the inner product, as the gradients are.
* **Every other parameter** (norm scales, biases: ~0.1 % of a transformer's): its
  per-sequence gradient is taken exactly, by substituting a per-sequence copy of it for the
  one forward (shape (n, 1, ..., *shape), broadcast like the original), which autograd
  differentiates per sequence; a Linear's bias is summed from its output gradient. One longer
  than r^2 is then projected to r^2 dimensions by a dense seeded Gaussian (a plain JL
  projection, unbiased the same way); a shorter one enters as it is. A module whose
  computation does not broadcast that way (``nn.LayerNorm``'s fused kernel, for one) is
  refused by name.

The sketch dimension m is the sum of r_a * r_b over the weight matrices plus the exact
parameters. Across processes (parameters or work split over ranks), K~ is a sum over
parameters, so each rank sketches the parameters assigned to it (by a fixed round-robin over
names, the same on every rank) and one ``all_reduce`` of the n x n matrix completes it; the
result does not depend on the number of processes, because the projections depend on the
seed and the parameter's name only.

Two sketches with different seeds are independent estimates of K; ``metric_g`` compares the
KL_min they give and folds their disagreement into ``damping_stable``.
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
    dim: int
    seed: int
    rank: int
    n_parameters: int
    n_exact: int  # parameters entered without projection (norm scales, biases, small sides)
    matrices: int  # weight matrices sketched

    @property
    def n(self) -> int:
        return self.kernel.shape[0]


def _projection(seed: int, name: str, side: str, r: int, size: int) -> torch.Tensor | None:
    """N(0, 1/r) entries, r x size, regenerated from (seed, name, side); None = identity."""
    if size <= r:
        return None
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"{name}/{side}".encode())) % (1 << 62))
    return torch.randn(r, size, generator=g, dtype=torch.float32) / float(np.sqrt(r))


def _owned(names: list[str], group) -> set[str]:
    if group is None:
        return set(names)
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return {nm for k, nm in enumerate(sorted(names)) if k % world == rank}


def sketched_kernel(model, seqs: Sequences, *, rank: int = 32, seed: int = 0, group=None) -> SketchedKernel:
    """K~ for the sequences ``seqs`` at the policy ``model`` (see the module docstring).

    ``rank`` is r, the sketch size of each side of each weight matrix; ``group`` a
    torch.distributed process group over which the parameters are split and K~ summed.
    """
    if rank < 1:
        raise WhiteboxError(f"sketch rank must be >= 1, not {rank}")
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

    proj = {nm: (_projection(seed, nm, "rows", rank, by_name[nm].shape[0]),
                 _projection(seed, nm, "cols", rank, by_name[nm].shape[1])) for nm in uses if nm in owned}
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

        def fwd(m, inputs, output):
            ids = inputs[0].detach().reshape(n, -1)
            u = torch.nn.functional.one_hot(ids, m.num_embeddings).float() if pa is None else pa.T[ids]
            if m.padding_idx is not None:  # torch gives the padding row no gradient
                u = u * (ids != m.padding_idx)[..., None]
            anchors.append(output)

            def back(g):
                add(nm, torch.einsum("ntr,nts->nrs", u.double(), side(pb, g).double()))
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
        raise WhiteboxError(f"the sketch could not take per-sequence gradients through this model ({exc}); "
                            "some module computes with a parameter in a way that does not broadcast over "
                            "sequences") from exc
    finally:
        for h in handles:
            h.remove()
        for nm, (mod, attr) in holder.items():
            mod._parameters[attr] = by_name[nm]
        model.train(was_training)

    k = np.zeros((n, n), dtype=np.float64)
    dim = n_exact = 0
    pieces = dict(parts)
    g_iter = iter(grads)
    for nm in copies:
        gs = [next(g_iter) for _ in copies[nm]]
        gs = [g.detach().double().reshape(n, -1) for g in gs if g is not None]
        if gs:
            pieces.setdefault(nm, []).append(sum(gs))
    for nm, ps in pieces.items():
        phi = ps[0] if len(ps) == 1 else sum(ps)
        projected = nm in proj and any(x is not None for x in proj[nm])
        if nm not in proj:  # a vector parameter: dense JL above r^2 entries
            dense = _projection(seed, nm, "dense", rank * rank, phi.shape[1])
            if dense is not None:
                phi, projected = phi @ dense.double().T, True
        k += (phi @ phi.T).numpy()
        dim += phi.shape[1]
        n_exact += 0 if projected else phi.shape[1]
    if group is not None:
        import torch.distributed as dist

        kt = torch.from_numpy(k)
        dist.all_reduce(kt, group=group)
        counts = torch.tensor([dim, n_exact], dtype=torch.float64)
        dist.all_reduce(counts, group=group)
        k, dim, n_exact = kt.numpy(), int(counts[0]), int(counts[1])
    if not np.isfinite(k).all():
        raise WhiteboxError("the sketched kernel has non-finite entries: the policy's log-probabilities overflowed")
    return SketchedKernel(kernel=k, dim=dim, seed=seed, rank=rank,
                          n_parameters=sum(p.numel() for p in by_name.values()), n_exact=n_exact, matrices=len(uses))
