"""Requests → device tensors: the KV cache slots, the per-request knob tensors, and each step's batch.

The runner owns every device tensor that lives longer than one pass:

* a ``SlotCache`` preallocated for ``num_slots`` requests (model/cache.py: full layers sized by the slot's context
  budget, sliding layers as mirrored rings), written in place by the encoder and read as views by the decoder;
* per-slot knob tables ([S] tensors: seed, t_min, t_max, N, β, τ; block index and steps left), written from the
  ``Request`` (the one per-request record): the request's constants once at admission, the block index and k
  before each step. The runner owns the one decrement of a request's steps left, after each step;
* the slot assignment, dense: running requests occupy slots 0..n−1. When one leaves, the last slot's cache and
  knobs are moved into the hole once, so a batch of the first B slots is a slice of every table, not a gather.

``run(reqs)`` is one denoising step for a list of requests: the decoder (on CPU the canvases stacked for the
batch-invariant row-wise ops and one ``decode_attention`` call per layer: ``model/stacked.py``, bitwise batch
invariant, docs/exactness.md; batched over the slots in place on accelerators, ``model/batched.py``), the LM
head a tile of canvases at a time, and the sampler. The batched path has static shapes per (B, length bucket) and
no allocation proportional to the context; capturing it in CUDA graphs is the GPU issues' work.

Memory: ``CacheConfig`` gives the cache budget (bytes, or a fraction of the memory the process may still take:
``free_memory``, which on the CPU heeds the container's cgroup limit); it decides how
many slots fit, and when not even one slot of ``max_model_len`` positions fits, the slot holds what does
(``slot_len``) and admission rejects a request that needs more (``request_checks.check_context``). The vision
tower's working memory for one tile of images is set aside first (``DiffusionGemma.image_workspace_bytes``;
docs/images.md, "Memory"). What the slots leave of the budget holds the prefix cache (engine/prefix_cache.py,
docs/prefix-caching.md): each full prompt chunk is copied out of the slot once encoded, and a request whose prompt
starts with cached chunks gets them copied into its slot at admission (``match_prefix``, between the scheduler's
admit and plan, then ``admit``).
"""

from __future__ import annotations

import logging
import time

import torch

from dgserve.config import ConfigError
from dgserve.engine.block import BlockState
from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.image_batch import chunk_images
from dgserve.engine.memory_room import read_memory, room_reader
from dgserve.engine.prefix_cache import KV, PrefixCache, PrefixCacheStats
from dgserve.engine.request import Request
from dgserve.engine.sampler import Sampler, StepKnobs
from dgserve.model import DiffusionGemma
from dgserve.model.batched import decode_slots
from dgserve.model.cache import SlotCache
from dgserve.model.stacked import decode_stacked, encode_stacked, stackable
from dgserve.ops.bits import to_signed64

log = logging.getLogger("dgserve")
# what the prefix cache leaves free in host memory for the process's own working memory (a pass's activations
# beyond what it already holds): it frees blocks rather than take the process closer than this to its limit
HOST_MIN_ROOM = 128 << 20


def free_memory(device: torch.device) -> tuple[int, str]:
    """(bytes this process may still take, what bounds them, for the log): CUDA's mem_get_info on a GPU; on the
    CPU the host's MemAvailable bounded by the memory limit of the process's cgroup less its usage
    (``memory_room.read_memory``)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return free, f"{free >> 20} MiB free on {device}"
    try:
        reading = read_memory()
    except OSError as e:
        raise ConfigError(f"kv_cache_memory: {e}; give a size in bytes") from e
    return reading.available, reading.describe()


def plan_slots(model: DiffusionGemma, max_num_seqs: int, max_model_len: int, chunk: int, budget: int):
    """(num_slots, slot_len): as many slots of max_model_len positions as the budget holds (at most
    max_num_seqs); if none fits, one slot of the most positions that do. ConfigError when not even one canvas
    after one token fits."""
    cfg, dtype = model.config, model.dtype
    per_slot = SlotCache.bytes_per_slot(cfg, max_model_len, chunk, dtype)
    n = min(max_num_seqs, budget // per_slot)
    if n >= 1:
        return n, max_model_len
    fixed = SlotCache.bytes_per_slot(cfg, 0, chunk, dtype)  # the sliding rings
    per_position = SlotCache.bytes_per_slot(cfg, 1, chunk, dtype) - fixed
    slot_len = min(max_model_len, (budget - fixed) // per_position if budget > fixed else 0)
    if slot_len < cfg.canvas_length + 1:
        least = fixed + per_position * (cfg.canvas_length + 1)
        raise ConfigError(
            f"kv_cache_memory: {budget} bytes hold no request (one slot needs {least} bytes for a one-token prompt"
            f" and one canvas; {per_slot} for max_model_len {max_model_len})"
        )
    return 1, slot_len


class ModelRunner:
    """Owns the slot cache and knob tables of one model; called from the engine thread only."""

    def __init__(
        self,
        model: DiffusionGemma,
        max_num_seqs: int,
        max_model_len: int,
        prefill_chunk: int,
        cache_config: CacheConfig | None = None,
        prefix_caching: bool = True,
    ):
        cc = cache_config or CacheConfig()
        self.model = model
        cfg, dev = model.config, model.device
        self.chunk = max(prefill_chunk, cfg.canvas_length)  # the most positions one pass writes
        budget, said = cc.memory, ""
        if budget is None:
            free, why = free_memory(dev)
            budget = int(cc.fraction * free)
            said = f", {cc.fraction} of {why}"
        # the vision tower's working memory for one tile of the largest images comes out of the budget
        # (docs/images.md, "Memory"); 0 for a model that cannot take images
        self.image_workspace = model.image_workspace_bytes()
        if self.image_workspace:
            budget = max(0, budget - self.image_workspace)
            soft = model.vision.config.max_soft_tokens if model.vision is not None else 0
            n = model.image_tile
            said += (
                f", after {self.image_workspace / 2**20:.1f} MiB set aside for the vision tower (a tile of "
                f"{n} image{'' if n == 1 else 's'} of {soft} soft tokens)"
            )
        if said:  # one line: what bounded the budget and what came out of it
            log.info("kv cache budget: %d MiB%s", budget >> 20, said)
        self.num_slots, self.slot_len = plan_slots(model, max_num_seqs, max_model_len, self.chunk, budget)
        self.cache = SlotCache(cfg, self.num_slots, self.slot_len, self.chunk, model.dtype, dev, zero=model.batch_rows)
        self.cache_bytes = self.num_slots * SlotCache.bytes_per_slot(cfg, self.slot_len, self.chunk, model.dtype)
        self.prefill_chunk = prefill_chunk
        # the prefix cache: one block per full prompt chunk, in what the slots leave of the budget
        self.prefix: PrefixCache | None = None
        if prefix_caching:
            layer_bytes = [prefill_chunk * b for b in SlotCache.layer_position_bytes(cfg, model.dtype)]
            # in host memory the cache keeps its blocks in maps of their own and yields to the process's other
            # memory (the container's limit included): docs/prefix-caching.md, "Memory and eviction"
            host = dev.type == "cpu"
            self.prefix = PrefixCache(
                prefill_chunk,
                layer_bytes,
                self.cache.sliding,
                cfg.sliding_window,
                budget - self.cache_bytes,
                page_backed=host,
                room=room_reader() if host else None,
                min_room=HOST_MIN_ROOM,
            )
        self.sampler = Sampler(model.dtype)
        S = self.num_slots

        def table(dtype: torch.dtype) -> torch.Tensor:  # [S], one row per slot
            return torch.zeros(S, dtype=dtype, device=dev)

        i64 = torch.int64
        self.knobs = StepKnobs(
            seed=table(i64),
            block_index=table(i64),
            steps_left=table(i64),
            t_min=table(torch.float64),
            t_max=table(torch.float64),
            max_denoising_steps=table(i64),
            entropy_bound=table(torch.float32),
            confidence=table(torch.float32),
        )
        self.occupants: list[Request] = []  # occupants[s] holds slot s

    # ------------------------------------------------------------------ slots

    def admit(self, req: Request, hit: list[KV] | None = None) -> None:
        """Give a request the next free slot and write its constant knob rows (seed, schedule, bounds) from it;
        ``hit``: the cached prompt chunks ``match_prefix`` found for it, copied into the slot."""
        s = len(self.occupants)
        if s >= self.num_slots:
            raise RuntimeError(f"model runner: no free slot for {req.request_id!r} ({self.num_slots} slots)")
        p, k = req.params, self.knobs
        k.seed[s], k.t_min[s], k.t_max[s] = to_signed64(req.seed), p.t_min, p.t_max
        k.max_denoising_steps[s], k.entropy_bound[s], k.confidence[s] = (
            p.max_denoising_steps,
            p.entropy_bound,
            p.confidence_threshold,
        )
        self.cache.lengths[s] = 0
        if hit:
            self.cache.copy_in(s, hit, self.prefill_chunk)
        req.slot = s
        self.occupants.append(req)

    def park(self, req: Request) -> None:
        """Set a running request aside between canvases (``Scheduler`` fair shares): its slot's KV cache is copied,
        exactly, into a cache of its own (in host memory: it waits off the device) and the slot is freed; ``resume``
        puts it back. Its tokens are those it would have had running on (docs/architecture.md, "Fair shares
        between callers")."""
        assert req.slot is not None and req.block is None, "park() is for a running request between canvases"
        n = self.cache.lengths[req.slot]
        host = torch.device("cpu")
        kept = SlotCache(self.model.config, 1, max(1, n), self.cache.chunk, self.model.dtype, host, zero=False)
        kept.load(self.cache, req.slot, 0)
        req.parked = kept
        self.release(req)

    def resume(self, req: Request) -> None:
        """A parked request back in a free slot: its knob rows written again (``admit``), its KV cache copied in."""
        kept, req.parked = req.parked, None
        assert kept is not None, "resume() of a request that was not parked"
        self.admit(req)
        assert req.slot is not None
        self.cache.load(kept, 0, req.slot)

    def match_prefix(self, req: Request) -> list[KV]:
        """At admission (``Engine.step``, between ``Scheduler.admit`` and ``Scheduler.plan``): the cached blocks
        that start ``req``'s prompt (each one whole chunk: ``len(hit) * prefill_chunk`` prompt tokens), for
        ``admit`` to copy into its slot; [] without prefix caching."""
        if self.prefix is None or not req.prefix_hashes:
            return []
        return self.prefix.match(req.prefix_hashes, req.prompt_len)

    def release(self, req: Request) -> None:
        """Free a request's slot; the last occupied slot moves into it (cache with its lengths, knobs: once)."""
        s = req.slot
        if s is None or s >= len(self.occupants) or self.occupants[s] is not req:
            return
        last = len(self.occupants) - 1
        if s != last:
            self.cache.move(last, s)
            for f in StepKnobs.__dataclass_fields__:
                t = getattr(self.knobs, f)
                t[s] = t[last]
            mover = self.occupants[last]
            self.occupants[s], mover.slot = mover, s
        self.occupants.pop()
        req.slot = None

    def holds_finished(self) -> bool:
        """Whether a slot is held by a request that finished or was aborted (``release_finished`` frees it)."""
        return any(r.finished for r in self.occupants)

    def release_finished(self) -> None:
        """Free the slots of requests that finished or were aborted since the last step."""
        for req in [r for r in self.occupants if r.finished]:
            self.release(req)

    # ------------------------------------------------------------------ passes

    @torch.inference_mode()
    def prefill(self, req: Request, start: int, end: int, image_embeds: torch.Tensor | None = None) -> None:
        """Encode prompt tokens start .. end − 1 (one chunk, after what the slot holds); a full chunk is then
        offered to the prefix cache. image_embeds [placeholders, H]: the soft tokens of the chunk's images, encoded
        by the iteration's one tower call (``image_batch.encode_planned``); None: the chunk's images (if any) are
        encoded here, for this request alone."""
        assert req.slot is not None, "prefill of a request without a slot"
        assert self.cache.lengths[req.slot] == start, "prompt chunks are encoded in order"
        if image_embeds is None:
            image_embeds = self._image_features(req, start, end)
        self._encode(req, req.prompt_ids[start:end], image_embeds)
        self.offer_prefix(req, start, end)

    def can_stack(self) -> bool:
        """Whether several requests' encoder passes may run as one (``prefill_stacked``, ``encode_pending``): the
        stacked CPU pass, each row bit for bit its own (model/stacked.py)."""
        return stackable(self.model)

    @torch.inference_mode()
    def prefill_stacked(self, chunks: list[tuple[Request, int, int]]) -> None:
        """``prefill`` of several requests' text-only prompt chunks (no image among their tokens) in one stacked
        encoder pass (``encode_stacked``): each slot gets the bits of its own ``prefill``. All or nothing: when it
        raises, no slot's length has moved and each chunk can be encoded on its own. Each chunk is then offered to
        the prefix cache (``offer_prefix``), request by request."""
        for req, start, _ in chunks:
            assert req.slot is not None and self.cache.lengths[req.slot] == start, "prompt chunks are encoded in order"
        self._encode_stacked([(req, req.prompt_ids[start:end]) for req, start, end in chunks])

    @torch.inference_mode()
    def encode_pending(self, reqs: list[Request]) -> None:
        """The committed blocks the requests' next ``start_block`` would encode one by one, encoded in one stacked
        pass; each request's ``pending`` is then cleared (all or nothing, as ``prefill_stacked``)."""
        for req in reqs:
            assert req.slot is not None and req.pending is not None, "encode_pending needs a pending block"
            req.encode_seconds = 0.0
        self._encode_stacked([(req, req.pending) for req in reqs])  # type: ignore[misc]
        for req in reqs:
            req.pending = None

    def _encode_stacked(self, work: list[tuple[Request, list[int]]]) -> None:
        """``_encode`` of several requests' tokens in one stacked pass; each is charged the pass's time."""
        t0 = time.perf_counter()
        dev = self.model.device
        rows = [self.cache.view(req.slot) for req, _ in work]  # type: ignore[arg-type]
        encode_stacked(self.model, rows, [torch.tensor(ids, dtype=torch.int64, device=dev) for _, ids in work])
        dt = time.perf_counter() - t0
        for req, _ in work:
            req.encode_seconds += dt

    def offer_prefix(self, req: Request, start: int, end: int) -> None:
        """A fully encoded prompt chunk start .. end − 1 of ``req`` goes to the prefix cache (copied out of the
        slot once; a chunk already cached is only touched)."""
        assert req.slot is not None
        c, off = divmod(start, self.prefill_chunk)
        if self.prefix is None or off or end - start != self.prefill_chunk or c >= len(req.prefix_hashes):
            return
        key, parent = req.prefix_hashes[c], req.prefix_hashes[c - 1] if c else None
        if not self.prefix.touch(key):  # not cached yet: copy it out of the slot
            # on the host the cache copies the views into its own maps; elsewhere the copies are made here
            self.prefix.store(key, parent, *self.cache.copy_out(req.slot, start, end, copy=not self.prefix.page_backed))

    def _image_features(self, req: Request, start: int, end: int) -> torch.Tensor | None:
        """The soft tokens of the images in prompt positions start .. end − 1 (whole: ``scheduler.chunk_end``),
        encoded now on the model's device: [placeholders, H], or None without images there."""
        inside = chunk_images(req, start, end)
        if not inside:
            return None
        return torch.cat(self.model.encode_images([(im.patches, im.positions) for im in inside]))

    def _encode(self, req: Request, ids: list[int], image_embeds: torch.Tensor | None = None) -> None:
        """Encode ``ids`` after what the request's slot holds (a prompt chunk or a committed block), with the soft
        tokens of the images whose placeholders they hold."""
        assert req.slot is not None
        t0 = time.perf_counter()
        ids_t = torch.tensor(ids, dtype=torch.int64, device=self.model.device)
        self.model.encode_row(ids_t, self.cache.view(req.slot), image_embeds)
        req.encode_seconds += time.perf_counter() - t0

    @torch.inference_mode()
    def start_block(self, req: Request) -> None:
        """Encode the previous block if one is pending, then start block ``req.block_index``: a fresh noise canvas
        (with the request's draft laid over it and its pins, docs/edit-in-place.md), N steps left, and the
        grammar's forced prefix when the request has one."""
        assert req.slot is not None, "a block for a request without a slot"
        if req.pending is not None:
            req.encode_seconds = 0.0
            self._encode(req, req.pending)
        req.denoise_seconds, req.pending = 0.0, None
        cfg = self.model.config
        req.block = BlockState.start(
            req.seed,
            req.block_index,
            cfg.canvas_length,
            cfg.vocab_size,
            self.model.device,
            req.initial_canvas,
            req.tracker.eos_ids,  # empty with ignore_eos
        )
        req.steps_left, req.block_done, req.mean_entropy = req.params.max_denoising_steps, False, float("nan")
        if req.grammar is not None:  # structured output: commit what the grammar forces before the first step
            req.grammar.start_block(req.block.canvas)

    @torch.inference_mode()
    def run(self, reqs: list[Request]) -> None:
        """One denoising step for ``reqs`` (each with a started block): decoder, LM head in tiles, sampler; then
        each request's steps left goes down by one (here only)."""
        blocks: list[BlockState] = []
        slots: list[int] = []
        for r in reqs:
            assert r.block is not None and r.slot is not None, "run() needs running requests with started blocks"
            blocks.append(r.block)
            slots.append(r.slot)
        rows = self._rows(slots)
        self._write_step_rows(reqs, rows)
        knobs = self.knobs.rows(rows)
        hidden = self._decode(blocks, slots, isinstance(rows, slice))
        # LM head + sampler a tile of canvases at a time; each tile's logits are freed once the sampler has used
        # them, and its processed logits once they made the self-conditioning signal of the rows that go on
        for tile, logits in self.model.logits_tiles(hidden):
            tile_reqs = reqs[tile]
            processed = self.sampler.step(tile_reqs, logits, knobs.rows(tile))
            del logits
            self._keep_self_conditioning(tile_reqs, processed)
            del processed
        for r in reqs:
            r.steps_left -= 1

    def _decode(self, blocks: list[BlockState], slots: list[int], prefix: bool) -> torch.Tensor:
        """The decoder pass over the blocks' canvases, each adding its self-conditioning signal [C, H] kept from
        the last step, which is then dropped → final hidden states [B, C, H]. prefix: the slots are 0..B−1."""
        canvas = torch.stack([b.canvas for b in blocks])
        sc = [b.self_cond for b in blocks]
        for b in blocks:  # consumed by this pass: the list below is the last reference
            b.self_cond = None
        none = [None] * len(sc)
        if self.model.batch_rows and len(blocks) > 1 and prefix:
            encoded = self.cache.lengths[: len(blocks)]  # the one record of positions per slot (host)
            lengths = torch.tensor(encoded, dtype=torch.int64).to(self.model.device, non_blocking=True)
            return decode_slots(self.model, self.cache, lengths, max(encoded), canvas, none, none, sc)
        # CPU: the canvases stacked, each with its own bits (docs/exactness.md, "Batch invariance")
        if len(blocks) > 1 and stackable(self.model):
            return decode_stacked(self.model, [self.cache.view(s) for s in slots], canvas, sc)
        # per canvas: one canvas, NVFP4/FP8 experts on the CPU, or an accelerator's batch not a prefix of the slots
        return torch.stack(
            [
                self.model.decode_row_hidden(self.cache.view(s), canvas[b], None, None, sc[b])
                for b, s in enumerate(slots)
            ]
        )

    def _keep_self_conditioning(self, reqs: list[Request], processed: torch.Tensor) -> None:
        """Each request whose block goes on keeps the next step's self-conditioning signal [C, H], made from its
        row of the tile's processed logits [n, C, V] (``DiffusionGemma.self_conditioning_rows``; docs/memory.md,
        "Self-conditioning state"); a finished block needs none (the next block starts without)."""
        going = [i for i, r in enumerate(reqs) if not r.block_done and r.block is not None]
        for i, signal in zip(going, self.model.self_conditioning_rows(processed, going), strict=True):
            block = reqs[i].block
            assert block is not None
            block.self_cond = signal

    def _write_step_rows(self, reqs: list[Request], rows: slice | torch.Tensor) -> None:
        """The moving knobs of this step (block index, k) into the slot tables, from the requests: one copy."""
        moving = torch.tensor([[r.block_index, r.steps_left] for r in reqs], dtype=torch.int64)
        moving = moving.to(self.model.device, non_blocking=True)
        self.knobs.block_index[rows], self.knobs.steps_left[rows] = moving[:, 0], moving[:, 1]

    def _rows(self, slots: list[int]) -> slice | torch.Tensor:
        """The knob rows of ``slots``: a slice when they are the first B slots in order (no copy), else an index."""
        if slots == list(range(len(slots))):
            return slice(0, len(slots))
        return torch.tensor(slots, dtype=torch.int64, device=self.model.device)

    def kv_cache_usage(self) -> float:
        """The fraction of the KV cache budget held, in [0, 1], in bytes: the slots' share for the positions encoded
        in the occupied slots (of ``num_slots * slot_len``), plus the prefix cache's held blocks, over the slots'
        bytes plus the prefix cache's capacity (the budget's two parts; held prefix blocks are evicted when a new
        block needs room, so a full prefix cache is not pressure on the slots). 0 when idle with an empty prefix
        cache. Safe to call from another thread (the metrics scrape): it reads host ints only, ``len(occupants)``,
        one copy of ``cache.lengths`` and the prefix cache's block count, taken under the GIL, so it is a snapshot
        that may straddle a step (a slot being moved or released) and is clamped to [0, 1]."""
        positions = sum(self.cache.lengths[: len(self.occupants)])
        held = self.cache_bytes * positions / (self.num_slots * self.slot_len)
        total = self.cache_bytes
        if self.prefix is not None:
            held += self.prefix.held_bytes
            total += self.prefix.capacity_bytes
        return min(1.0, max(0.0, held / total))

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's bytes held, capacity and eviction counts (None without prefix caching): host ints,
        safe to read from the metrics scrape (a snapshot that may straddle a step)."""
        p = self.prefix
        if p is None:
            return None
        return PrefixCacheStats(p.held_bytes, p.capacity_bytes, len(p), p.evicted_blocks, p.dropped_sliding)
