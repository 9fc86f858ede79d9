"""Core: the sharded layout of one tensor dim over the ranks of one mesh axis (pure tensor math).

A dim of full size F sharded over `world` ranks with interleave k is viewed as k equal blocks
of F/k (a fused [q|k|v] projection has k=3). Rank r holds, for every block, the r-th of
`world` equal slices of that block, concatenated in block order. With k=1 this is Megatron's
plain split (rank r holds [r*F/world, (r+1)*F/world)); with k>1 it is what Megatron's
`partition_stride` gives a fused projection, so that splitting a rank's piece into k equal
parts yields whole heads of each of q, k and v.

Example, F=12, k=3, world=2 (elements named by their index):

    full    [0 1 2 3 | 4 5 6 7 | 8 9 10 11]       three blocks of 4
    rank 0  [0 1 | 4 5 | 8 9]                    first half of every block
    rank 1  [2 3 | 6 7 | 10 11]                   second half of every block

The interleave may also be a tuple of block *proportions*: a fused projection whose parts
differ in size, Phi-3's [q|k|v] with grouped-query attention (8 query heads, 4 kv heads:
proportions (2, 1, 1)). Block i then has F * w_i / sum(w) elements and rank r holds the r-th
slice of each. An equal tuple is written as its count: (1, 1, 1) is 3.

A count may also be symbolic, a sympy expression in the batch size: BLOOM folds batch and
heads into one dim (B*heads, S, d) with the heads split, B blocks of `heads` each. Such a
placement lives only in the graph: its collectives unflatten the dim into (B, heads) and move
the heads (passes/redistribute.py), and no parameter or checkpoint ever has one.

Some blocks may be held *whole* by every rank (`whole`: their indices): a fused [q|k|v] under
multi-query attention splits its query heads and keeps the one key and value head on every
rank. Rank r then holds the r-th slice of each split block and all of each whole block, in
block order; only parameters are laid out so.

No communication happens here; the ops of `fxtron.ops` move the pieces between ranks.
"""
from __future__ import annotations

import math

import sympy
import torch

from fxtron.errors import ParallelizeError

Interleave = int | tuple[int, ...] | sympy.Expr


def numel(shape, *, symbolic: bool = False):
    """The number of elements of a tensor of `shape`: an int for int sizes, a sympy expression
    when a size is symbolic (the batch, the sequence) or `symbolic` asks for one (reports
    divide counts exactly)."""
    n = sympy.Integer(1) if symbolic else 1
    for s in shape:
        n = n * (s if isinstance(s, sympy.Expr) else int(s))
    return n


def is_symbolic(interleave) -> bool:
    """A count in the batch size (see the module docstring), not a number."""
    return isinstance(interleave, sympy.Expr) and not interleave.is_Integer


def normalize(interleave) -> Interleave:
    """An interleave in its one spelling: a count k >= 1, proportions (a tuple of >= 2
    positive ints, not all equal, in lowest terms), or a symbolic count."""
    if isinstance(interleave, sympy.Expr):
        return int(interleave) if interleave.is_Integer else interleave
    if isinstance(interleave, int):
        if interleave < 1:
            raise ValueError(f"interleave must be >= 1, not {interleave}")
        return interleave
    w = tuple(int(x) for x in interleave)
    if not w or any(x < 1 for x in w):
        raise ValueError(f"interleave proportions must be positive, not {w}")
    g = math.gcd(*w)
    w = tuple(x // g for x in w)
    return len(w) if len(set(w)) == 1 else w


def n_blocks(interleave: Interleave) -> int:
    return interleave if isinstance(interleave, int) else len(interleave)


def block_sizes(size: int, interleave: Interleave) -> list[int]:
    """The sizes of the blocks of a dim of `size` (full or one rank's: the proportions are the
    same). Raises ValueError when `size` does not split in those proportions."""
    w = [1] * interleave if isinstance(interleave, int) else list(interleave)
    total = sum(w)
    if size % total:
        raise ValueError(f"size {size} does not split into blocks in the proportions {':'.join(map(str, w))}")
    return [size // total * x for x in w]


def to_list(interleave: Interleave) -> list[int]:
    """The interleave as the collectives' `int[]` argument: [k], or the proportions."""
    return [interleave] if isinstance(interleave, int) else list(interleave)


def from_list(values) -> Interleave:
    values = list(values)
    return normalize(values[0] if len(values) == 1 else tuple(values))


def check_divisible(size: int, world: int, interleave: Interleave, what: str) -> None:
    """Raise ParallelizeError unless a dim of `size` can be sharded over `world` ranks with
    `interleave` blocks, i.e. unless every block's size is divisible by world (for a count k:
    size % (k * world) == 0).

    `what` names the dim in the message (e.g. "weight of 'mlp.fc1' dim 0"); the message says
    what to change: the size, the tp size, or the interleave.
    """
    if not isinstance(interleave, int):
        try:
            blocks = block_sizes(size, interleave)
        except ValueError as e:
            raise ParallelizeError(f"{what}: {e}") from None
        if world >= 1 and all(b % world == 0 for b in blocks):
            return
        raise ParallelizeError(
            f"{what}: size {size} is fused blocks of {', '.join(map(str, blocks))} (each split over the ranks), "
            f"and not every block divides over {world} tensor-parallel ranks; use a tp size that divides "
            f"{math.gcd(*blocks)} (for attention: the number of kv heads)")
    if world < 1 or interleave < 1:
        raise ParallelizeError(f"{what}: world ({world}) and interleave ({interleave}) must be >= 1")
    unit = world * interleave
    if size % unit == 0:
        return
    if interleave == 1:
        raise ParallelizeError(
            f"{what}: size {size} cannot be split over {world} tensor-parallel ranks (not divisible "
            f"by {world}); make the size a multiple of {world} (pad it, e.g. the vocabulary) or use a "
            f"tp size that divides {size}")
    hint = (f"use a tp size that divides {size // interleave} (each of the {interleave} blocks has "
            f"{size // interleave})" if size % interleave == 0 else
            f"the size is not even divisible by its {interleave} fused blocks; check the interleave")
    raise ParallelizeError(
        f"{what}: size {size} viewed as {interleave} interleaved blocks cannot be split over "
        f"{world} tensor-parallel ranks ({interleave} x {world} = {unit} does not divide {size}); "
        f"make the size a multiple of {unit} or {hint}")


def _norm_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise IndexError(f"dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim if ndim else 0


def local_block_sizes(full_size: int, world: int, interleave: Interleave, whole: tuple[int, ...]) -> list[int]:
    """The sizes of one rank's blocks of a dim of `full_size`: each split block's 1/world, each
    whole block's all."""
    return [b if i in whole else b // world for i, b in enumerate(block_sizes(full_size, interleave))]


def blocks_of_piece(local: int, world: int, interleave: Interleave, whole: tuple[int, ...] = ()) -> list[int]:
    """The sizes of the blocks of one rank's piece of `local` elements along the dim (what
    `shard` gave it): the proportions of the full blocks, each split one divided by world."""
    if not whole:
        return block_sizes(local, interleave)
    w = [1] * interleave if isinstance(interleave, int) else list(interleave)
    # full block i is u * w_i; a piece holds u * w_i of a whole one, u * w_i / world of a split one
    u = local * world // sum(x * world if i in whole else x for i, x in enumerate(w))
    return [u * x if i in whole else u * x // world for i, x in enumerate(w)]


def local_size(full_size: int, world: int, interleave: Interleave = 1, whole: tuple[int, ...] = ()) -> int:
    """One rank's size of a dim of `full_size` sharded over `world` ranks."""
    return sum(local_block_sizes(full_size, world, interleave, whole)) if whole else full_size // world


def shard(full: torch.Tensor, dim: int, world: int, rank: int, interleave: Interleave = 1,
          whole: tuple[int, ...] = ()) -> torch.Tensor:
    """This rank's piece of `full` along `dim`: a new contiguous tensor (never a view).

    In: the full tensor, the dim (negative counts from the end), the number of ranks, this
    rank's index in [0, world), and the interleave k. Out: a tensor equal to `full` except that
    `dim` has size F/world and holds the r-th slice of every one of the k blocks (see the
    module docstring: F=12, k=3, world=2, rank=0 -> elements [0,1,4,5,8,9]).
    Raises ParallelizeError when F is not divisible by k*world.
    """
    dim = _norm_dim(dim, full.dim())
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    size = full.shape[dim]
    if whole:                                # split blocks' r-th slice, whole blocks entire
        pieces = [b if i in whole else b.narrow(dim, rank * (b.shape[dim] // world), b.shape[dim] // world)
                  for i, b in enumerate(full.split(block_sizes(size, interleave), dim))]
        return torch.cat(pieces, dim).contiguous()
    check_divisible(size, world, interleave, f"dim {dim} of a tensor of shape {tuple(full.shape)}")
    if not isinstance(interleave, int):      # unequal blocks: the r-th slice of each
        pieces = [b.narrow(dim, rank * (b.shape[dim] // world), b.shape[dim] // world)
                  for b in full.split(block_sizes(size, interleave), dim)]
        return torch.cat(pieces, dim).contiguous()
    part = size // (interleave * world)
    piece = full.unflatten(dim, (interleave, world, part)).select(dim + 1, rank)  # [..., k, part, ...]
    return piece.flatten(dim, dim + 1).clone(memory_format=torch.contiguous_format)


def unshard(pieces: list[torch.Tensor], dim: int, interleave: Interleave = 1,
            whole: tuple[int, ...] = ()) -> torch.Tensor:
    """The full tensor from every rank's piece: the inverse of `shard`.

    In: the pieces in rank order (equal shapes; each one's `dim` is k*part), the dim and the
    interleave k they were sharded with. Out: a new tensor whose `dim` is len(pieces) times
    larger, laid out as k blocks, block b being the concatenation over ranks of each piece's
    b-th part. E.g. pieces [0,1,4,5,8,9] and [2,3,6,7,10,11] with k=3 give [0..11].
    """
    if not pieces:
        raise ValueError("unshard needs at least one piece")
    shape = pieces[0].shape
    for i, p in enumerate(pieces):
        if p.shape != shape:
            raise ValueError(f"piece {i} has shape {tuple(p.shape)}, piece 0 has {tuple(shape)}; "
                             f"all pieces of one tensor have the same shape")
    dim = _norm_dim(dim, len(shape))
    local = shape[dim]
    if whole:                                # whole blocks from the first piece, split ones joined
        parts = [p.split(blocks_of_piece(local, len(pieces), interleave, whole), dim) for p in pieces]
        return torch.cat([parts[0][i] if i in whole else torch.cat([q[i] for q in parts], dim)
                          for i in range(len(parts[0]))], dim).contiguous()
    if not isinstance(interleave, int):      # unequal blocks: block i is every rank's i-th part
        parts = [p.split(block_sizes(local, interleave), dim) for p in pieces]
        return torch.cat([torch.cat([q[i] for q in parts], dim) for i in range(len(interleave))], dim).contiguous()
    if interleave < 1 or local % interleave:
        raise ValueError(f"a piece's dim {dim} has size {local}, not divisible by interleave {interleave}")
    part = local // interleave
    blocks = [p.unflatten(dim, (interleave, part)) for p in pieces]   # [..., k, part, ...]
    full = torch.stack(blocks, dim=dim + 1)                           # [..., k, world, part, ...]
    return full.flatten(dim, dim + 2).contiguous()


__all__ = ["Interleave", "block_sizes", "blocks_of_piece", "check_divisible", "from_list", "local_block_sizes", "local_size",
           "n_blocks", "normalize", "shard", "to_list", "unshard"]
