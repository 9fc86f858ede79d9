"""What-if sizing: which meshes fit a model in a given GPU memory, ranked by a modeled
step time — "will Llama-70B train on 64 cards of 80 GB, and how" in seconds, without a GPU.

The model (every rate is an assumption, printed with the result; the formulas are
Korthikanti et al. 2022's activation memory, Narayanan et al. 2021's bubbles and the ring
collectives' bus-bandwidth factors):

  parameters      P from the model itself; per rank P / tp without pp, with pp the fullest
                  rank's: the layers' 1/pp plus V h for the embedding (first stage) or the output
                  layer (last stage; both on rank 0 under ZB-V), all / tp; experts / (tp ep pp);
                  context parallel (cp) splits tokens, not weights
  weights         mixed precision as fxtron holds it: 4 B fp32 parameters (the main weights)
                  + 2 B 16-bit compute copies + 4 B fp32 main grads + 8 B Adam moments per
                  parameter; the distributed optimizer (zero=1, and zero=2, whose gradients are
                  whole during backward) divides the moments by dp (the fp32 parameters stay
                  whole on every rank: 10 + 8/dp, where Megatron's layout is 6 + 12/dp), zero=3
                  all 18 B, plus two layers' 16-bit weights gathered at once (one computing, the
                  next prefetched)
  activations     Korthikanti et al. 2022, bytes per layer with 16-bit activations:
                  tp: s b h (10 + 24/t + 5 a s/(h t));  tp+sp: (s b h / t)(34 + 5 a s/h);
                  the first pipeline stage holds pp microbatches of L/pp layers = L layers
                  (Eq. 5), x (1 + (p-1)/(p v)) interleaved; under cp a rank holds s/cp of the
                  tokens against all s keys: s -> s/cp in the s b h factor, not in 5as/h
  compute         model FLOPs 72 B L s h^2 (1 + s/(6h) + V/(12 h L)) per step (Eq. 7), at
                  `flops_per_s` x `efficiency` per GPU
  bubble          x (1 + (p-1)/(v m)) (Narayanan et al. 2021)
  tp comm         4 all-reduces (2 forward, 2 backward) of b s h 16-bit values per layer and
                  microbatch, ring 2(t-1)/t, at the intra-node bandwidth (tp stays in a node);
                  sequence parallel's all-gathers and reduce-scatters move the same bytes, plus
                  the 2 linear inputs gathered again in backward (one all-reduce's worth); full
                  recomputation runs the forward's 2 again
  pp comm         b s h 16-bit values per microbatch each way per boundary (x v interleaved),
                  at the inter-node bandwidth
  cp comm         per layer and microbatch, 16-bit, h_kv = h (no grouped-query saving assumed),
                  as the runtime moves them: the ring (p2p) K and V of b (s/c) h each, c-1 steps
                  forward and 2c-1 backward (the blocks again, then their gradients); a2a
                  (Ulysses, where tp x cp divides the heads) four all-to-alls each way of (c-1)/c
                  of b (s/c) h; a2a+p2p with groups of a (where tp x a divides the heads) those
                  all-to-alls at (a-1)/a inside the group, and the ring of the g = c/a groups
                  moving K and V of b (s/g) (h/a) each, g-1 steps forward and 2g-1 backward;
                  intra-node when tp x (the group) fits a node, else inter-node
  dp comm         ring all-reduce 2(d-1)/d of the fp32 gradients (reduce-scatter + all-gather
                  of the same bytes under zero=1) over the d = dp x cp ranks that hold the same
                  weights (Megatron's dp-cp group), at the inter-node bandwidth, not overlapped;
                  an expert's over its edp = world/(tp ep pp) replicas; zero=3 per microbatch
                  (d-1)/d of 2 + 2 + 4 bytes a parameter (16-bit gathers in forward and again in
                  backward, the fp32 reduce-scatter), modeled not overlapped although the runtime
                  prefetches the next layer's gather and reduce-scatters during backward
  experts         a mixture of experts (E experts, top-k) splits its expert weights over ep
                  (and tp): per rank dense/(tp pp) + experts/(tp ep pp) parameters; compute
                  counts the k active experts only: 6 B s (P - (1-k/E) P_experts - V h)
                  + 12 B L s^2 h + 6 B s h V (the dense formula of Eq. 7 written per parameter);
                  ep comm: 4 all-to-alls (dispatch and combine, forward and backward) of
                  (e-1)/e k b s h 16-bit values per MoE layer and microbatch (Megatron's all-to-all dispatcher,
                  dropless under uniform routing), every tp rank sending its copy; intra-node
                  when tp x ep fits a node; activations as a dense layer of the same width
  recomputation   a mesh that does not fit is tried again with recomputation (Korthikanti et
                  al. 2022 Sec. 4): selective drops the 5as/h term (attention cores) and adds one
                  forward of them, 4 B L s^2 h FLOPs; full keeps each layer's input, 2 s b h / t
                  (/t under sp) a layer, plus one layer's activations while it is recomputed, and
                  adds one forward of the layers, 24 B L s h^2 (1 + s/(6h)) FLOPs (Eq. 7's 72 ->
                  96) and its tp collectives; the table's recompute column names the cheapest
                  that fits
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from fxtron.errors import ParallelizeError
from fxtron.runtime.dp import default_bucket_size


@dataclass(frozen=True)
class ModelDims:
    """What the cost model needs of a transformer: layers, hidden size, attention heads,
    vocabulary, parameters, and for a mixture of experts its experts, top-k, expert
    parameters and MoE layers."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    params: int
    experts: int = 0            # a mixture of experts: experts per MoE layer (0: dense)
    top_k: int = 0              # experts each token runs
    expert_params: int = 0      # parameters of the expert weights (all layers)
    moe_layers: int = 0


@dataclass(frozen=True)
class Hardware:
    """Assumed rates (defaults: an 80 GB A100-class GPU, 8 per node, NVLink and InfiniBand)."""

    memory: float = 80 * 2**30
    flops_per_s: float = 312e12           # bf16 dense peak
    efficiency: float = 0.5               # fraction of peak the GEMMs reach
    intra_node_bw: float = 300e9          # bytes/s per GPU, NVLink (tp)
    inter_node_bw: float = 25e9           # bytes/s per GPU, InfiniBand (pp, dp)
    gpus_per_node: int = 8


@dataclass(frozen=True)
class Candidate:
    """One mesh and how the model of the module docstring rates it (seconds, bytes)."""

    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    schedule: str
    virtual_stages: int
    microbatches: int
    zero: int
    weights_bytes: float
    activation_bytes: float
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    cp: int = 1
    cp_comm_s: float = 0.0
    ep: int = 1
    ep_comm_s: float = 0.0
    recompute: str | None = None       # None, "selective" or "full" (parallelize's recompute=)
    tp_hidden_s: float = 0.0           # of tp_comm_s, behind the weight-gradient GEMMs
    dp_hidden_s: float = 0.0           # of dp_comm_s, behind the last microbatch's backward
    activations_from: str = "formula"  # "formula" (Korthikanti) or "measured" (tools/activations.py)
    cp_comm_type: str = "p2p"          # how cp attention exchanges keys: p2p, a2a or a2a+p2p
    cp_a2a_size: int | None = None     # a2a+p2p: the cp ranks of one all-to-all group

    @property
    def memory_bytes(self) -> float:
        return self.weights_bytes + self.activation_bytes

    @property
    def step_s(self) -> float:
        """Compute, bubble and the communication nothing hides."""
        return (self.compute_s + self.bubble_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.cp_comm_s
                + self.ep_comm_s - self.tp_hidden_s - self.dp_hidden_s)

    def as_dict(self) -> dict:
        return {**asdict(self), "memory_bytes": self.memory_bytes, "step_s": self.step_s}


# ----------------------------------------------------------------------------- formulas
def weight_bytes(params_per_rank: float, dp: int, zero: int) -> float:
    """Bytes per parameter as fxtron's runtime holds them in mixed precision: 4 (the fp32
    parameters, the optimizer's main weights) + 2 (their 16-bit compute copies, during the step)
    + 4 (fp32 main_grad) + 8 (Adam's moments) = 18. The distributed optimizer (zero=1) divides
    the moments by dp: each rank steps its shard of the fp32 parameters, which stay whole on every
    rank (runtime/zero.py; Megatron keeps the 16-bit weights whole and shards the fp32 ones, 6 +
    12/dp); zero=2's gradients are whole during backward, its peak as zero=1's; zero=3 divides
    all 18 (its gathered layers are counted apart)."""
    if zero >= 3:
        return params_per_rank * 18 / dp
    return params_per_rank * (10 + 8 / (dp if zero else 1))


RECOMPUTE = (None, "selective", "full")


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int, sp: bool, cp: int = 1,
                               recompute: str | None = None) -> float:
    """Korthikanti et al. 2022 Table 2 (16-bit activations): Eq. 2 (tp) or Eq. 4 (tp+sp);
    t=1 gives Eq. 1, sbh(34 + 5as/h). Under context parallel a rank holds s/cp of the tokens,
    whose attention scores still span all s keys: (s/cp) b h (... + 5as/h ...). Selective
    recomputation drops the 5as/h term; full keeps the layer's input, 2sbh (/t under sp)."""
    local = s / cp
    scores = 0 if recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        return 2 * local * b * h / (t if sp else 1)
    if sp or t == 1:
        return local * b * h / t * (34 + scores)
    return local * b * h * (10 + 24 / t + scores / t)


def first_stage_activation_bytes(dims: ModelDims, s: int, b: int, t: int, sp: bool, p: int, v: int = 1,
                                 cp: int = 1, recompute: str | None = None) -> float:
    """The first pipeline stage's activations under 1F1B: p microbatches x L/p layers = L
    layers (Eq. 5), x (1 + (p-1)/(p v)) for the interleaved schedule (under full recomputation
    the layers' inputs; `rate` adds the one layer being recomputed)."""
    total = dims.layers * activation_bytes_per_layer(s, b, dims.hidden, dims.heads, t, sp, cp, recompute)
    if v > 1:
        total *= 1 + (p - 1) / (p * v)
    return total


def recompute_flops(dims: ModelDims, batch: int, s: int, recompute: str | None) -> float:
    """FLOPs recomputation adds per step: one forward of the attention cores (q k^T and the
    product with v, 4 B L s^2 h) for selective, one forward of the layers for full: a third of
    `model_flops` without the head's 6 B s h V (24 B L s h^2 (1 + s/(6h)) for a dense model;
    a mixture of experts' active experts only)."""
    if recompute == "selective":
        return 4 * batch * dims.layers * s * s * dims.hidden
    if recompute == "full":
        return (model_flops(dims, batch, s) - 6 * batch * s * dims.hidden * dims.vocab) / 3
    return 0.0


def model_flops(dims: ModelDims, batch: int, s: int) -> float:
    """Korthikanti Eq. 7: 72 B L s h^2 (1 + s/(6h) + V/(12 h L)), forward and backward; for
    a mixture of experts the same per parameter with only the k active experts' counted:
    6 B s (P - (1-k/E) P_experts - V h) + 12 B L s^2 h + 6 B s h V."""
    h, L = dims.hidden, dims.layers
    if not dims.experts:
        return 72 * batch * L * s * h * h * (1 + s / (6 * h) + dims.vocab / (12 * h * L))
    active = dims.params - (1 - dims.top_k / dims.experts) * dims.expert_params - dims.vocab * h
    return 6 * batch * s * active + 12 * batch * L * s * s * h + 6 * batch * s * h * dims.vocab


def narayanan_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Narayanan et al. 2021 Eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))."""
    h, l = hidden, layers
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def measured_stage_activation_bytes(saved, layer_saved, dims: ModelDims, *, pp: int, m: int, schedule: str, v: int,
                                    cp: int = 1, recompute: str | None = None) -> float:
    """The most activation bytes a pipeline rank holds, from one microbatch's measured figures
    at the same tp, sp and recomputation (activations.Saved: per layer, before the layers,
    after them): the first stage holds min(m, p) microbatches of L/p layers and the embedding's
    (x (1 + (p-1)/(p v)) interleaved; all m under GPipe), the last one microbatch of L/p layers
    and the head's; ZB-V puts both ends on rank 0, with p microbatches in flight over its two
    chunks. Under cp a rank holds s/cp of the tokens (its scores s/cp x s): / cp. Full
    recomputation adds the region held whole while backward recomputes it (measured; else
    `layer_saved`'s layer, measured without recomputation)."""
    layers = dims.layers / pp * saved.per_layer
    in_flight = m if schedule == "gpipe" else min(m, pp)
    if schedule == "zb-v":
        act = in_flight * (layers + saved.pre + saved.post)
    else:
        first = in_flight * (layers + saved.pre) * (1 + (pp - 1) / (pp * v) if v > 1 else 1)
        last = (m if schedule == "gpipe" else 1) * (layers + saved.post)
        act = max(first, last) if pp > 1 else layers + saved.pre + saved.post
    if recompute == "full":
        act += saved.recomputed or layer_saved.per_layer
    return act / cp


def stage_dense_params(dims: ModelDims, pp: int, schedule: str = "1f1b") -> float:
    """The dense parameters of the pipeline rank that holds the most: the layers' 1/pp plus the
    embedding (V h) on the first stage and the output layer (V h: untied, or the tied
    embedding's copy, Megatron's embedding group) on the last; under ZB-V rank 0 holds both
    ends (its V). Without pp, all of them."""
    dense = dims.params - dims.expert_params
    if pp <= 1:
        return dense
    ends = dims.vocab * dims.hidden
    layers = max(dense - 2 * ends, 0.0)
    return layers / pp + ends * (2 if schedule == "zb-v" else 1)


def rate(dims: ModelDims, hw: Hardware, *, world: int, tp: int, pp: int, sp: bool, schedule: str, v: int,
         global_batch: int, seq: int, micro_batch: int, zero: int, cp: int = 1, ep: int = 1,
         recompute: str | None = None, activations=None, bucket_size: int | None = None,
         cp_comm_type: str = "p2p", cp_a2a_size: int | None = None) -> Candidate:
    """One mesh rated by the module's model. `activations`: (tp, sp, recompute) ->
    activations.Saved of one microbatch (measured on fake tensors, 16-bit), or None for
    Korthikanti's formulas."""
    dp = world // (tp * pp * cp)
    edp = world // (tp * ep * pp)
    m = global_batch // (dp * micro_batch)
    b, s, h = micro_batch, seq, dims.hidden
    experts = dims.expert_params / (tp * ep * pp)
    dense = stage_dense_params(dims, pp, schedule) / tp
    # zero=1 shards the dense weights' state over dp-cp, the experts' over expert-dp
    weights = weight_bytes(dense, dp * cp, zero) + weight_bytes(experts, edp, zero)
    if zero >= 3 and dp * cp > 1:     # a layer gathered whole (16-bit) and the next one prefetched
        weights += 2 * 2 * (dense + experts) / max(1, dims.layers // pp)
    saved = activations(tp, sp, recompute) if activations is not None else None
    if saved is not None:
        layer = activations(tp, sp, None) if recompute == "full" else None
        act = measured_stage_activation_bytes(saved, layer, dims, pp=pp, m=m, schedule=schedule, v=v, cp=cp,
                                              recompute=recompute)
    else:
        act = first_stage_activation_bytes(dims, s, b, tp, sp, pp, v if schedule == "interleaved" else 1, cp,
                                           recompute) * (min(m, pp) / pp if schedule != "gpipe" else m / pp)
        if recompute == "full":       # the layer being recomputed, whole for a moment
            act += activation_bytes_per_layer(s, b, h, dims.heads, tp, sp, cp)
    flops = model_flops(dims, global_batch, s) + recompute_flops(dims, global_batch, s, recompute)
    compute = flops / world / (hw.flops_per_s * hw.efficiency)
    if pp == 1:
        bubble = 0.0
    elif schedule == "zb-v":          # (p-1) forwards of a half-stage chunk, at F = B = W (Qi et al. 2024)
        bubble = compute * (pp - 1) / (6 * m)
    else:
        bubble = compute * (pp - 1) / (v * m)
    # an all-reduce's bytes per (layer, microbatch): 2 forward, 2 backward; sequence parallel's
    # gather and reduce-scatter pairs move the same, plus the 2 inputs gathered again in backward
    # (one all-reduce's worth); full recomputation runs the forward's 2 again
    tp_ars = 4 + (1 if sp else 0) + (2 if recompute == "full" else 0)
    tp_bytes = tp_ars * 2 * (tp - 1) / tp * b * s * h * 2 * (dims.layers / pp) * m if tp > 1 else 0.0
    pp_bytes = 2 * b * s * h * 2 / (tp if sp else 1) * v * m if pp > 1 else 0.0
    d = dp * cp
    if zero >= 3:   # per microbatch: gathered (16-bit) in forward and again in backward, fp32 gradients reduce-scattered
        per_param = (2 + 2 + 4) * m
        dp_bytes = ((d - 1) / d * dense * per_param if d > 1 else 0.0) + \
            ((edp - 1) / edp * experts * per_param if edp > 1 else 0.0)
    else:
        dp_bytes = (2 * (d - 1) / d * dense * 4 if d > 1 else 0.0) + \
            (2 * (edp - 1) / edp * experts * 4 if edp > 1 else 0.0)
    cp_s = 0.0
    if cp > 1:
        a = {"a2a": cp, "a2a+p2p": cp_a2a_size}.get(cp_comm_type, 1)
        inner, outer = cp_bytes(a, cp, b * s * h / tp * 2 * (dims.layers / pp) * m)
        bw = lambda n: hw.intra_node_bw if tp * n <= hw.gpus_per_node else hw.inter_node_bw  # noqa: E731
        cp_s = inner / bw(a) + outer / bw(cp)
    # the copies of the rank's tokens (its s/cp under cp) out and back, forward and backward
    ep_bytes = 4 * (ep - 1) / ep * dims.top_k * b * (s / cp) * h * 2 * (dims.moe_layers / pp) * m if ep > 1 else 0.0
    ep_bw = hw.intra_node_bw if tp * ep <= hw.gpus_per_node else hw.inter_node_bw
    tp_s, dp_s = tp_bytes / hw.intra_node_bw, dp_bytes / hw.inter_node_bw
    # what the runtime overlaps: each backward all-reduce (or sp's gather and reduce-scatter) of
    # the input gradients runs while the weight-gradient GEMMs, a third of the compute, run
    tp_hidden = min(tp_s * (tp_ars - 2 - (2 if recompute == "full" else 0)) / tp_ars, compute / 3) if tp > 1 else 0.0
    # the dp buckets are reduced as the last microbatch's backward completes them (two thirds of
    # a microbatch's compute), all but the last bucket hidden; zero=3's gathers are not modelled so
    dp_hidden = 0.0
    if dp_s and zero < 3:
        buckets = max(1, -(-int(dense + experts) // (bucket_size or default_bucket_size(dp * cp))))
        dp_hidden = min(dp_s - dp_s / buckets, 2 * compute / (3 * m))
    return Candidate(tp, pp, dp, sp, schedule, v, m, zero, weights, act, compute, bubble, tp_s,
                     pp_bytes / hw.inter_node_bw, dp_s, cp, cp_s, ep, ep_bytes / ep_bw, recompute,
                     tp_hidden, dp_hidden, "measured" if saved is not None else "formula", cp_comm_type,
                     cp_a2a_size if cp_comm_type == "a2a+p2p" else None)


def cp_bytes(a: int, cp: int, bsh: float) -> tuple[float, float]:
    """Bytes a rank moves for one attention's cp exchange, forward and backward, when the
    all-to-alls run over groups of `a` cp ranks (1: the ring alone, p2p; cp: Ulysses alone,
    a2a) and the ring over the g = cp/a groups: (inside the groups, across them). `bsh`:
    bytes of one (b, s, h) activation, whole sequence. The all-to-alls carry q, k, v one way
    and the output back, forward and again backward: 8 (a-1)/a of the rank's b (s/cp) h; the
    ring carries K and V of the head split, b (s/g) (h/a) each, g-1 steps forward and 2g-1
    backward."""
    g = cp // a
    return 8 * (a - 1) / a * bsh / cp, (3 * g - 2) * 2 * bsh / cp if g > 1 else 0.0


def candidates(dims: ModelDims, hw: Hardware, *, world: int, global_batch: int, seq: int, micro_batch: int = 1,
               fits_only: bool = True, activations=None, progress: bool | None = None) -> list[Candidate]:
    """Every (tp, pp, cp, ep, dp, sp, schedule, zero) that divides the model, the batch and
    the sequence (cp: 2 x cp chunks; ep: the experts, and tp x ep x pp the world, its ranks drawn
    from dp x cp), ranked by modeled step time; only those whose memory fits
    `hw.memory` unless fits_only=False. A mesh that fits only with recomputation comes with the
    cheapest that makes it fit (selective, then full: `Candidate.recompute`). `progress`: a
    bar over the tp sizes on stderr (each measures its activations, seconds apiece; default:
    when stderr is a terminal)."""
    import sys
    out = []
    tps = [tp for tp in _divisors(world) if tp <= hw.gpus_per_node and not dims.heads % tp]
    if progress is None:
        progress = sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(tps, desc="planning", unit="tp size", leave=False, file=sys.stderr)
    try:
        return _candidates(dims, hw, tps, bar, world=world, global_batch=global_batch, seq=seq,
                           micro_batch=micro_batch, fits_only=fits_only, activations=activations, out=out)
    finally:
        if bar is not None:
            bar.close()


def _candidates(dims, hw, tps, bar, *, world, global_batch, seq, micro_batch, fits_only, activations, out):
    """`candidates`' search, tp size by tp size (the bar, when given, iterates them)."""
    for tp in (bar if bar is not None else tps):
        if bar is not None:
            bar.set_postfix_str(f"tp={tp}, {len(out)} meshes fit so far")
        for pp in _divisors(world // tp):
            if dims.layers % pp:
                continue
            for cp in _divisors(world // (tp * pp)):
                if seq % (2 * cp) and cp > 1:
                    continue
                dp = world // (tp * pp * cp)
                if global_batch % (dp * micro_batch):
                    continue
                m = global_batch // (dp * micro_batch)
                eps = [e for e in _divisors(dims.experts) if (world // (tp * pp)) % e == 0] if dims.experts else [1]
                for ep in eps:
                    for sp in ([False, True] if tp > 1 else [False]):
                        scheds = [("1f1b", 1)]
                        if pp > 1 and m % pp == 0 and dims.layers % (2 * pp) == 0:
                            scheds.append(("interleaved", 2))
                        if pp > 1 and dims.layers % (2 * pp) == 0:
                            scheds.append(("zb-v", 2))
                        for schedule, v in scheds:
                            for zero in ([0, 1, 2, 3] if dp * cp > 1 else [0]):
                                # without recomputation where that fits, else the cheapest that does
                                comms = [("p2p", None)] + ([("a2a", None)] if cp > 1 and dims.heads % (tp * cp) == 0
                                                           else [])
                                comms += [("a2a+p2p", a) for a in range(2, cp) if cp % a == 0
                                          and dims.heads % (tp * a) == 0]
                                for comm, a in comms:
                                    for recompute in RECOMPUTE:
                                        p = rate(dims, hw, world=world, tp=tp, pp=pp, sp=sp, schedule=schedule,
                                                 v=v, global_batch=global_batch, seq=seq, micro_batch=micro_batch,
                                                 zero=zero, cp=cp, ep=ep, recompute=recompute,
                                                 activations=activations, cp_comm_type=comm, cp_a2a_size=a)
                                        if p.memory_bytes <= hw.memory:
                                            out.append(p)
                                            break
                                    else:
                                        if not fits_only:
                                            out.append(rate(dims, hw, world=world, tp=tp, pp=pp, sp=sp,
                                                            schedule=schedule, v=v, global_batch=global_batch,
                                                            seq=seq, micro_batch=micro_batch, zero=zero, cp=cp,
                                                            ep=ep, activations=activations, cp_comm_type=comm,
                                                            cp_a2a_size=a))
    return sorted(out, key=lambda p: (p.step_s, p.memory_bytes))


class MeasuredActivations:
    """(tp, sp, recompute) -> what one microbatch of `micro_batch` x `seq` tokens leaves saved
    for backward on a tp rank (activations.Saved: per layer, before and after the layers), the
    model compiled at that tp and run on fake tensors in 16 bits: the measure `inspect` gives
    and the memory tracker takes, not a formula. Each key is compiled once (a second or two for
    a 7B model); None where the model cannot be run so (the planner then uses the formulas)."""

    def __init__(self, model, args: tuple, kwargs: dict | None = None, *, micro_batch: int, seq: int,
                 dtype: str = "bf16"):
        self.model, self.args, self.kwargs = model, args, kwargs or {}
        self.micro_batch, self.seq, self.dtype = micro_batch, seq, dtype
        self._cache: dict[tuple, object] = {}
        self.errors: dict[tuple, str] = {}

    def __call__(self, tp: int, sp: bool, recompute: str | None):
        key = (tp, sp, recompute)
        if key not in self._cache:
            import warnings

            import fxtron
            from fxtron.tools.activations import saved_bytes
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", fxtron.ParallelizeWarning)
                    pm = fxtron.parallelize(self.model, fxtron.Mesh(tp, tp=tp), example_inputs=self.args,
                                            example_kwargs=self.kwargs, sequence_parallel=sp, recompute=recompute,
                                            dtype=self.dtype)
                    (self._cache[key],) = saved_bytes(pm, 0, self.micro_batch, self.seq)
            except ParallelizeError as e:
                self._cache[key] = None
                self.errors[key] = str(e)
        return self._cache[key]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def dims_of(traced) -> ModelDims:
    """Layers, hidden size, heads and vocabulary read from a traced graph (the layer list,
    the embedding's weight, the attention's query shape) and the parameter count."""
    import torch
    from fxtron.core import meta
    from fxtron.passes.pp import find_layer_list
    aten = torch.ops.aten
    _, units = find_layer_list(traced)
    vocab = hidden = heads = None
    params = 0
    for node in traced.graph.nodes:
        if meta.is_param(node):
            params += node.meta["val"].numel()
        if node.op != "call_function":
            continue
        if node.target == aten.embedding.default and vocab is None:
            vocab, hidden = (int(d) for d in node.args[0].meta["val"].shape)
        if heads is None and node.target in (aten.scaled_dot_product_attention.default,):
            heads = int(node.args[0].meta["val"].shape[1])
    if vocab is None or heads is None:
        raise ParallelizeError("what-if sizing needs a transformer with a token embedding and scaled_dot_product_attention")
    from fxtron.passes.ep import moe_layers
    layers = moe_layers(traced)
    if not layers:
        return ModelDims(layers=len(units), hidden=hidden, heads=heads, vocab=vocab, params=params)
    experts = layers[0].n_experts
    weights = {p for layer in layers for p in layer.params}
    picks = [int(n.args[1]) for n in traced.graph.nodes if n.op == "call_function" and n.target == aten.topk.default
             and int(n.args[0].meta["val"].shape[-1]) == experts]
    return ModelDims(layers=len(units), hidden=hidden, heads=heads, vocab=vocab, params=params, experts=experts,
                     top_k=picks[0] if picks else 1, expert_params=sum(p.meta["val"].numel() for p in weights),
                     moe_layers=len(layers))


def format_candidates(ps: list[Candidate], hw: Hardware, *, top: int = 10) -> str:
    from tabulate import tabulate
    rows = []
    for p in ps[:top]:
        rows.append([p.tp, p.pp, f"{p.cp} {p.cp_comm_type}" + (f":{p.cp_a2a_size}" if p.cp_a2a_size else "") if p.cp > 1 else p.cp, p.ep, p.dp, "on" if p.sequence_parallel else "-",
                     p.schedule + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""), p.microbatches,
                     p.zero, p.recompute or "-", f"{p.memory_bytes / 2**30:.1f}", f"{p.compute_s:.3f}", f"{p.bubble_s:.3f}",
                     f"{p.tp_comm_s:.3f}", f"{p.cp_comm_s:.3f}", f"{p.ep_comm_s:.3f}", f"{p.pp_comm_s:.3f}",
                     f"{p.dp_comm_s:.3f}", f"{p.tp_hidden_s + p.dp_hidden_s:.3f}", f"{p.step_s:.3f}"])
    measured = {p.activations_from for p in ps[:top]}
    acts = ("activations measured (the model run on fake tensors at each tp, sp and recomputation, 16-bit)"
            if measured == {"measured"} else "16-bit activations by Korthikanti's formulas"
            if measured <= {"formula"} else "activations measured where the model ran on fake tensors, else formulas")
    assumed = (f"assumed: {hw.memory / 2**30:.0f} GiB per GPU, {hw.flops_per_s / 1e12:.0f} TFLOP/s peak at "
               f"{hw.efficiency:.0%}, tp over {hw.intra_node_bw / 1e9:.0f} GB/s (<= {hw.gpus_per_node} GPUs a node), "
               f"pp, dp (and cp, ep beyond a node) over {hw.inter_node_bw / 1e9:.0f} GB/s, {acts}, Adam, "
               "recomputation only where a mesh does not fit without it.\n"
               "overlapped (hidden s): the backward's tp communication behind the weight-gradient GEMMs, the dp "
               "buckets behind the last microbatch's backward (all but the last bucket); not overlapped: tp in "
               "forward, pp, cp, ep, zero=3's gathers. zb-v: bubble (p-1)/(6m) of the compute at F = B = W, "
               "twice 1F1B's pp bytes, 1F1B's memory with both ends on rank 0")
    return tabulate(rows, headers=["tp", "pp", "cp", "ep", "dp", "sp", "schedule", "m", "zero", "recompute", "GiB / GPU", "compute s",
                                   "bubble s", "tp comm s", "cp comm s", "ep comm s", "pp comm s", "dp comm s",
                                   "hidden s", "step s"]) + "\n" + assumed


def parse_bytes(text: str) -> float:
    """'80GiB', '80 GB', '1.5TiB' -> bytes."""
    t = text.strip().replace(" ", "")
    units = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "TB": 1e12, "GB": 1e9, "MB": 1e6, "B": 1}
    for u, f in units.items():
        if t.endswith(u):
            return float(t[: -len(u)]) * f
    return float(t)


__all__ = ["ModelDims", "Hardware", "Candidate", "MeasuredActivations", "candidates", "measured_stage_activation_bytes", "rate", "dims_of", "format_candidates", "parse_bytes",
           "weight_bytes", "activation_bytes_per_layer", "first_stage_activation_bytes", "model_flops", "recompute_flops",
           "narayanan_params"]
