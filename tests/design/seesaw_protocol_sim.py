"""Protocol simulation of the 64-row path's KV ring: consume_two_stage (consumer_rows64.cuh) with
copy_fp8_tiles and widen_fp8_tiles (producer_fp8.cuh), at two stages of 64 tokens (the seesaw order
that releases tile a before S(b): kSFirst = false), at the short-split kernel's four stages of 32 (S
first), and at two stages with the fp8 TMA pages' copies (a launch with tma != "off" on a page size
TMA serves: copy warp 0 alone waits for and issues the full tiles, one arrival of 64 per slot whose
bytes land in any order, then the copy warps' named barrier; the partial last tile, if the seed makes
one, by both warps); and with the 16-bit producer (producer.cuh produce: one in-order copy per slot
into two stages of 64, S first), uniform (one segment) and on the balanced schedule's walk
(scheduled.cuh produce_scheduled / consume_scheduled: segments of 0-9 tiles, each from stage 0 with the
stages' parities carried; before each segment's Q but the first the producer waits on q_empty, which
every math warp arrives on once done with Q; the math warpgroups meet at kBarEnd after each segment,
between writing their row sums and reading each other's). Q's copies land independently of the tiles'
(on TMA pages the tiles come by TMA, Q by cp.async).

Agents: 2 copy warps, 2 widening warps, 2 math warpgroups (each as one agent, arriving 4 warp
arrivals per release). mbarriers use the hardware parity rule: try_wait.parity(P) passes iff the
barrier's current (incomplete) phase index % 2 != P. Each wait also carries the phase the code
means to wait for; a pass with a different completed-phase count is a stale-phase error.
cp.async arrivals are deferred events fired at random times (in order per copy warp).
Data checks: a slot's next copy must come after every read of its previous tile; widening reads
raw bytes only after both copy warps' copies landed; math reads only after both widen warps wrote;
the upper-row (raw-overwriting) widen writes only after both widen warps read the raw bytes. At the
end every barrier must be between phases (no partial arrivals) and every named barrier between
generations. A deadlock, a stale pass, an over-arrival or a data race is reported per configuration.

mutation= injects a bug the checks must catch (so the simulation can fail):
  full32         kv_full initialised for one widening warp's 32 arrivals instead of 64
  early_release  warpgroup 0 releases its half of V (slots 0-3) of tile a right after S(a), before P V(a)
  no_w8          the widening warps skip the barrier between reading the raw bytes and overwriting them
  tma_no_bar     TMA pages without the copy warps' named barrier (copy warp 1 then waits for a slot's
                 release a phase too early; only the TMA configuration runs)
  q_release_first  the math warps arrive on q_empty when a segment starts, before their S wgmmas read
                 Q (only the scheduled configuration runs)
  no_phase_carry the math warps' waits take each segment's stage parities from 0 instead of carrying
                 them (only the scheduled configuration runs)
  no_q_wait      the math warps do not wait on q_full for a segment after the first (scheduled only)
  no_end_bar     the math warpgroups do not meet at kBarEnd (16-bit configurations)

    python3 tests/design/seesaw_protocol_sim.py [seeds per case, default 200] [--mutation=NAME]
    # 200: minutes; the design tests run main(6): 5 configurations
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol_kit import MB, NB, NSUB, Err, barrier_op, cli, empty_count, segments_of, step_one, sweep  # noqa: E402

NCOPY, NWIDEN = 2, 2  # copy warps (raw_full counts their 64 threads), widening warps (kv_full: 64)

class Sim:
    def __init__(s, n, ring, sfirst, groups, rng, policy, mutation=None, tma=False, b16=False, segs=None):
        assert mutation in (None, "full32", "early_release", "no_w8", "tma_no_bar", "q_release_first",
                            "no_phase_carry", "no_q_wait", "no_end_bar"), mutation
        s.segs = [n] if segs is None else segs  # the CTA's segments' tile counts (16-bit scheduled: several)
        s.n, s.ring, s.rng, s.policy, s.mutation, s.b16 = sum(s.segs), ring, rng, policy, mutation, b16
        n = s.n
        # Per tile t (numbered across segments): its segment, index in it, stage (a segment's tile 0 takes
        # stage 0), use of that stage (its parity is the barriers' parity) and the stage's previous tile.
        s.seg_of, s.local, s.stage, s.use, s.prev = [], [], [], [], []
        uses, last = [0] * ring, [None] * ring
        for k, m in enumerate(s.segs):
            for j in range(m):
                st = j % ring
                s.seg_of.append(k); s.local.append(j); s.stage.append(st); s.use.append(uses[st]); s.prev.append(last[st])
                uses[st] += 1
                last[st] = len(s.stage) - 1
        # TMA pages: the full tiles (all but a partial last one, which the seed decides) go by TMA
        s.tma, s.n_full = tma, (n - rng.randrange(2)) if tma else 0
        full_count = 128 if b16 else 32 if mutation == "full32" else 64
        s.kv_full = [MB(f"kv_full[{i}]", full_count) for i in range(ring * NSUB)]
        s.kv_empty = [MB(f"kv_empty[{i}]", empty_count(i // NSUB, i % NSUB)) for i in range(ring * NSUB)]
        s.raw_full = [MB(f"raw_full[{i}]", 64) for i in range(ring * NSUB)]
        s.q_full = MB("q_full", 128)
        s.q_empty = MB("q_empty", 8)  # one arrival per math warp (each warpgroup agent arrives 4)
        s.q_in = None                 # the segment whose Q the producer last wrote
        s.q_reads = {}                # segment -> its S wgmma groups (readers of Q) completed
        s.nb = {k: NB(k, 2) for k in ("MaxA", "PA", "MaxPB", "W8", "C7", "End")}
        # cp.async lands in order per warp, TMA in any order; Q (16-bit producer) on its own
        s.events = {"copy0": [], "copy1": [], "tma": [], "q": []}
        s.q_late = rng.random() < 0.5  # in half the runs Q's copies land as late as they can (q_full's case)
        s.row_sum = {0: {}, 1: {}}    # row_sum[buf][wg] -> the segment whose row sums it holds
        s.sums_pending = {}           # reader wg -> segments whose row sums it has yet to read
        # data state per slot
        s.landed = {}               # (t, slot) -> number of copy warps whose bytes landed
        s.raw_read = {}             # (t, slot) -> widen warps that read raw
        s.widened = {}              # (t, slot) -> widening warps that wrote all rows
        s.full_arrived = {}         # (t, slot) -> producer writers that arrived on kv_full
        s.reads_done = {}           # (t, slot) -> set of (reader) completed
        s.pending_reads = {}        # (agent) -> list of (t, slots, tag) in flight (wgmma groups)
        s.rowmax = {0: [], 1: []}   # log of ('w'|'r', pair)
        s.sfirst, s.groups = sfirst, groups
        if b16:  # the 16-bit producer warpgroup: Q, then every slot of every tile in order (cp.async)
            s.agents = {"copy0": s.produce16()}
        else:
            s.agents = {"copy0": s.copy(0), "copy1": s.copy(1), "widen0": s.widen(0), "widen1": s.widen(1)}
        s.agents.update({"wg0": s.math(0), "wg1": s.math(1)})

    def check_readers_done(s, t, c, what):
        """Slot c of tile t overwrites the stage's previous tile there: every reader of that use must be done."""
        prev = s.prev[t]
        if prev is not None:
            need = s.required_readers(prev, c)
            got = s.reads_done.get((prev, c), set())
            if not need <= got:
                raise Err(f"{what} tile {prev} before readers {sorted(need - got)} are done")

    # readers that tile t's slot c must see complete before slot reuse
    def required_readers(s, t, c):
        owner = s.local[t] % 2
        r = {f"S{owner}"}
        if c == NSUB - 1:
            r |= {"PV0", "PV1"}
        else:
            r.add(f"PV{c // 4}")
        return r

    def readable(s, t, c):
        """Whether the math warps may read tile t's slot c: its 16-bit bytes landed, or it was widened."""
        return s.landed.get((t, c), 0) >= 1 if s.b16 else s.widened.get((t, c), 0) == NWIDEN

    # ---------------- the 16-bit producer (produce, cp.async path)
    def produce16(s):
        t, k = 0, 0  # the next tile; segments with tiles so far (Q's fills)
        for m in s.segs:
            if m == 0:
                continue  # no tiles: no Q either
            if k > 0:
                yield ("wait", s.q_empty, (k & 1) ^ 1, k, f"producer Q fill {k}")
            yield ("check_q_write", s.seg_of[t])
            yield ("async_arrive", "q", s.q_full, 128, ("Q", s.seg_of[t]), 1)
            k += 1
            for _ in range(m):
                for c in range(NSUB):
                    slot = s.stage[t] * NSUB + c
                    yield ("wait", s.kv_empty[slot], (s.use[t] & 1) ^ 1, s.use[t], f"producer t{t} c{c}")
                    yield ("check_copy", t, c, 0)
                    yield ("async_arrive", "copy0", s.kv_full[slot], 128, (t, c), 1)
                t += 1

    # ---------------- copy warps (copy_fp8_tiles, two calls: tile 0, then 1..n-1; Q is rounded between)
    def copy(s, w):
        yield from s.copy_call(w, 0, 1)
        yield ("arrive", s.q_full, 32)
        yield from s.copy_call(w, 1, s.n)

    def copy_call(s, w, first, last):
        if s.tma:  # warp 0 waits for and issues the full tiles (one arrival of 64 plus 4 KiB each), then the C7 barrier
            full = min(last, s.n_full)
            if w == 0:
                for t in range(first, full):
                    for c in range(NSUB):
                        slot = (t % s.ring) * NSUB + c
                        yield ("wait", s.kv_empty[slot], ((t // s.ring) & 1) ^ 1, t // s.ring, f"copy0 tma t{t} c{c}")
                        yield ("check_copy", t, c, w)
                        yield ("async_arrive", "tma", s.raw_full[slot], 64, (t, c), NCOPY)
            if s.mutation != "tma_no_bar":
                yield ("nb_sync", s.nb["C7"], f"copy{w}")
            first = max(first, full)
        for t in range(first, last):
            stage = t % s.ring
            empty_parity = ((t // s.ring) & 1) ^ 1
            for c in range(NSUB):
                slot = stage * NSUB + c
                yield ("wait", s.kv_empty[slot], empty_parity, t // s.ring, f"copy{w} t{t} c{c}")
                yield ("check_copy", t, c, w)
                yield ("async_arrive", f"copy{w}", s.raw_full[slot], 32, (t, c), 1)

    # ---------------- widening warps
    def widen(s, w):
        yield ("arrive", s.q_full, 32)
        for t in range(s.n):
            stage = t % s.ring
            parity = (t // s.ring) & 1
            for grp in s.groups:
                for c in grp:
                    yield ("wait", s.raw_full[stage * NSUB + c], parity, t // s.ring + 1, f"widen{w} t{t} c{c}")
                    yield ("check_raw_read", t, c, w)
                if s.mutation != "no_w8":
                    yield ("nb_sync", s.nb["W8"], f"widen{w}")
                for c in grp:
                    yield ("check_upper_write", t, c, w)
                    yield ("arrive_full", s.kv_full[stage * NSUB + c], 32, (t, c))

    # ---------------- math warpgroups (consume_two_stage)
    def issue_s(s, wg, t, stage, parity):
        want = s.use[t] + 1
        if s.mutation == "no_phase_carry":
            parity, want = (s.local[t] // 2) & 1, s.local[t] // 2 + 1
        for c in range(NSUB):
            yield ("wait", s.kv_full[stage * NSUB + c], parity, want, f"wg{wg} S t{t} c{c}")
            yield ("check_math_read", t, c)
        yield ("group", wg, (t, tuple(range(NSUB)), f"S{wg}", s.seg_of[t]))  # reads Q of its segment too

    def pv(s, wg, t):
        slots = tuple(range(4 * wg, 4 * wg + 4)) + (NSUB - 1,)
        yield ("group", wg, (t, slots, f"PV{wg}", None))

    def rel(s, wg, stage, first, cnt):
        for j in range(cnt):
            yield ("arrive", s.kv_empty[stage * NSUB + first + j], 4)

    def math(s, wg):
        """rows_64 per segment: consume_two_stage over its tiles (then the q_empty arrival), and (16-bit)
        the epilogue's row-sum hand-over: write row_sum[seg & 1][wg], kBarEnd, read both warpgroups'."""
        t0, k, pair = 0, 0, 0  # the segment's first tile; segments with tiles so far; pairs so far
        for j, m in enumerate(s.segs):
            if m:
                yield from s.math_segment(wg, t0, m, k, pair)
                k += 1
            if s.b16:
                yield ("row_sum", "w", j, wg)
                if s.mutation != "no_end_bar":
                    yield ("nb_sync", s.nb["End"], f"wg{wg}")
                yield ("row_sum", "r", j, wg)
            t0 += m
            pair += (m + 1) // 2

    def math_segment(s, wg, t0, m, k, pair):
        """consume_two_stage over tiles t0 .. t0 + m - 1 (k: Q's fill; pair: row_max's pair count)."""
        sfirst = s.sfirst
        if not (s.mutation == "no_q_wait" and k > 0):
            yield ("wait", s.q_full, k & 1, k + 1, f"wg{wg} q fill {k}")
        if s.mutation == "q_release_first":
            yield ("arrive", s.q_empty, 4)
        for i in range((m + 1) // 2):
            a, b = t0 + 2 * i, t0 + 2 * i + 1
            has_b = 2 * i + 1 < m
            sa, sb = s.stage[a], s.stage[a] + 1
            p0 = s.use[a] & 1
            p1 = s.use[b] & 1 if has_b else None
            if wg == 0:
                yield from s.issue_s(0, a, sa, p0)
                yield ("wgwait", 0, 0)
                yield from s.rel(0, sa, 4, 4)
                if s.mutation == "early_release":
                    yield from s.rel(0, sa, 0, 4)
                yield ("rowmax", 0, "w", pair + i)
                yield ("nb_arrive", s.nb["MaxA"], "wg0")
                yield ("nb_arrive", s.nb["PA"], "wg0")
                yield from s.pv(0, a)
                yield ("wgwait", 0, 0)
                if s.mutation != "early_release":
                    yield from s.rel(0, sa, 0, 4)
                yield from s.rel(0, sa, NSUB - 1, 1)
                if has_b:
                    yield ("nb_sync", s.nb["MaxPB"], "wg0")
                    yield ("rowmax", 1, "r", pair + i)
                    yield from s.pv(0, b)
                    yield ("wgwait", 0, 0)
                    yield from s.rel(0, sb, 0, 4)
                    yield from s.rel(0, sb, NSUB - 1, 1)
            else:
                if sfirst and has_b:
                    yield from s.issue_s(1, b, sb, p1)
                yield ("nb_sync", s.nb["MaxA"], "wg1")
                yield ("rowmax", 0, "r", pair + i)
                yield ("nb_sync", s.nb["PA"], "wg1")
                yield from s.pv(1, a)
                if not sfirst:
                    yield ("wgwait", 1, 0)
                    yield from s.rel(1, sa, 4, 4)
                    yield from s.rel(1, sa, NSUB - 1, 1)
                    if has_b:
                        yield from s.issue_s(1, b, sb, p1)
                if has_b:
                    yield ("wgwait", 1, 1 if sfirst else 0)
                    yield from s.rel(1, sb, 0, 4)
                    yield ("rowmax", 1, "w", pair + i)
                    yield ("nb_arrive", s.nb["MaxPB"], "wg1")
                    if sfirst:
                        yield ("wgwait", 1, 0)
                        yield from s.rel(1, sa, 4, 4)
                        yield from s.rel(1, sa, NSUB - 1, 1)
                    yield from s.pv(1, b)
                    yield ("wgwait", 1, 0)
                    yield from s.rel(1, sb, 4, 4)
                    yield from s.rel(1, sb, NSUB - 1, 1)
                elif sfirst:
                    yield ("wgwait", 1, 0)
                    yield from s.rel(1, sa, 4, 4)
                    yield from s.rel(1, sa, NSUB - 1, 1)
        if s.b16 and s.mutation != "q_release_first":  # rows_64: every math warp is done with Q
            yield ("arrive", s.q_empty, 4)

    # ---------------- op execution: returns True if op completed, False if blocked
    def try_op(s, name, op):
        done = barrier_op(op)
        if done is not None:
            return done
        k = op[0]
        if k == "arrive_full":
            _, mb, cnt, tc = op
            s.full_arrived[tc] = s.full_arrived.get(tc, 0) + 1
            mb.arrive(cnt); return True
        if k == "async_arrive":
            s.events[op[1]].append((op[2], op[3], op[4], op[5])); return True
        if k == "group":
            _, wg, rd = op
            for c in rd[1]:
                if not s.readable(rd[0], c):
                    raise Err(f"{rd[2]} reads tile {rd[0]} slot {c} before its bytes are there")
            if rd[3] is not None and s.b16 and (s.q_in != rd[3] or not s.landed.get(("Q", rd[3]))):
                raise Err(f"{rd[2]} of segment {rd[3]} reads Q before it is there (Q of segment {s.q_in} written)")
            s.pending_reads.setdefault(wg, []).append(rd); return True
        if k == "wgwait":
            _, wg, keep = op
            lst = s.pending_reads.get(wg, [])
            while len(lst) > keep:
                t, slots, tag, q_seg = lst.pop(0)
                for c in slots:
                    s.reads_done.setdefault((t, c), set()).add(tag)
                if q_seg is not None:
                    s.q_reads[q_seg] = s.q_reads.get(q_seg, 0) + 1
            return True
        if k == "row_sum":  # row_sum[seg & 1]: each warpgroup writes its own, then reads both
            _, rw, j, wg = op
            buf = s.row_sum[j & 1]
            if rw == "w":
                for reader in (0, 1):
                    if (j - 2) in s.sums_pending.get(reader, set()):
                        raise Err(f"wg{wg} writes row_sum[{j & 1}] for segment {j} before wg{reader} read segment {j - 2}'s")
                buf[wg] = j
                for reader in (0, 1):
                    s.sums_pending.setdefault(reader, set()).add(j)
            else:
                for w in (0, 1):
                    if buf.get(w) != j:
                        raise Err(f"wg{wg} reads row_sum[{j & 1}][{w}] for segment {j}, which holds segment {buf.get(w)}'s")
                s.sums_pending[wg].discard(j)
            return True
        if k == "check_q_write":  # Q's previous segment: every S wgmma (one per tile) has completed
            prev = s.q_in
            if prev is not None and s.q_reads.get(prev, 0) != s.segs[prev]:
                raise Err(f"producer overwrites Q of segment {prev} after {s.q_reads.get(prev, 0)} of its "
                          f"{s.segs[prev]} S wgmmas completed")
            s.q_in = op[1]
            return True
        if k == "check_copy":
            _, t, c, w = op
            s.check_readers_done(t, c, f"copy{w} (for tile {t}, slot {c}) overwrites")
            prev = s.prev[t]
            if prev is not None and not s.b16:
                if s.widened.get((prev, c), 0) != NWIDEN:
                    raise Err(f"copy{w} overwrites slot {c} of tile {prev} before it was widened")
            return True
        if k == "check_raw_read":
            _, t, c, w = op
            if s.landed.get((t, c), 0) != NCOPY:
                raise Err(f"widen{w} reads raw of tile {t} slot {c} before both copy warps landed")
            s.raw_read.setdefault((t, c), set()).add(w)
            return True
        if k == "check_upper_write":
            _, t, c, w = op
            if len(s.raw_read.get((t, c), ())) != NWIDEN:
                raise Err(f"widen{w} overwrites raw of tile {t} slot {c} before the other widen warp read it")
            s.widened[(t, c)] = s.widened.get((t, c), 0) + 1
            return True
        if k == "check_math_read":
            _, t, c = op
            if s.b16:
                if not s.readable(t, c):
                    raise Err(f"math reads tile {t} slot {c} before its bytes landed")
                return True
            if s.widened.get((t, c), 0) != NWIDEN:
                raise Err(f"math reads tile {t} slot {c} before widened ({s.widened.get((t, c), 0)} of {NWIDEN} writers)")
            if s.full_arrived.get((t, c), 0) != NWIDEN:
                raise Err(f"math reads tile {t} slot {c} after {s.full_arrived.get((t, c), 0)} of {NWIDEN} producer arrivals")
            return True
        if k == "rowmax":
            _, buf, rw, i = op
            log = s.rowmax[buf]
            # writer of buffer: wg0 for buf 0, wg1 for buf 1; reader: the other. A write must come after
            # the read of the buffer's previous write (pairs are counted across segments; a segment's
            # last pair without tile b writes no row_max[1]).
            writes = [j for rw2, j in log if rw2 == "w"]
            if rw == "w" and writes and ("r", writes[-1]) not in log:
                raise Err(f"row_max[{buf}] of pair {i} written before pair {writes[-1]}'s was read")
            if rw == "r" and ("w", i) not in log:
                raise Err(f"row_max[{buf}] of pair {i} read before written")
            if rw == "r" and any(j > i for j in writes):
                raise Err(f"row_max[{buf}] pair {i} overwritten before read")
            log.append((rw, i)); return True
        raise Err(f"bad op {op}")

    def run(s, max_steps=10 ** 6):
        cur, done = {}, set()
        for k, g in s.agents.items():
            try:
                cur[k] = next(g)
            except StopIteration:  # nothing to do (a scheduled producer whose segments have no tiles)
                done.add(k)
        steps = 0
        while True:
            steps += 1
            runnable = []
            for k in s.agents:
                if k in done: continue
                runnable.append(k)
            ev = [k for k, q in s.events.items() if q]
            if s.q_late and "q" in ev and len(ev) > 1:
                ev.remove("q")  # Q lands only when nothing else can
            progressed = False
            order = runnable[:]
            prod = ("copy", "widen")
            if s.policy == "random":
                s.rng.shuffle(order)
            elif s.policy == "producer_first":
                order.sort(key=lambda k: (0 if k.startswith(prod) else 1, s.rng.random()))
            elif s.policy == "math_first":
                order.sort(key=lambda k: (1 if k.startswith(prod) else 0, s.rng.random()))
            elif s.policy in ("wg0_first", "wg1_first"):
                first = s.policy[:3]
                rank = lambda k: 0 if k == first else (3 if k.startswith("wg") else (2 if k.startswith("widen") else 1))
                order.sort(key=lambda k: (rank(k), s.rng.random()))
            # fire events lazily: with prob 0.3 before agents, always if nothing else runs
            if ev and s.rng.random() < 0.3 and not (s.q_late and ev == ["q"]):
                s.fire(s.rng.choice(ev)); progressed = True
            else:
                progressed = step_one(order, cur, s.agents, done, s.try_op)
                if not progressed and ev:
                    s.fire(s.rng.choice(ev)); progressed = True
            if len(done) == len(s.agents) and not any(s.events.values()):
                break
            if not progressed:
                blk = {k: (cur[k][0], cur[k][-1] if cur[k][0] == "wait" else cur[k][1:]) for k in s.agents if k not in done}
                raise Err(f"DEADLOCK: {blk}")
            if steps > max_steps:
                raise Err("too many steps")
        # everything consumed?
        for t in range(s.n):
            for c in range(NSUB):
                need = s.required_readers(t, c)
                if not need <= s.reads_done.get((t, c), set()):
                    raise Err(f"tile {t} slot {c} not fully read")
        # barriers balanced: every kv_empty has no partial phase
        for mb in s.kv_empty + s.kv_full + s.raw_full + [s.q_full, s.q_empty]:
            if mb.pending != mb.count:
                raise Err(f"{mb.name} ends with a partial phase ({mb.count - mb.pending} of {mb.count})")
        for nb in s.nb.values():
            if nb.arrived:
                raise Err(f"named barrier {nb.name} ends with arrivals of {sorted(nb.arrived)}")

    def fire(s, k):
        q = s.events[k]
        mb, n, (t, c), copies = q.pop(s.rng.randrange(len(q)) if k == "tma" else 0)
        s.landed[(t, c)] = s.landed.get((t, c), 0) + copies
        mb.arrive(n)


SCHEDULED_ONLY = ("q_release_first", "no_phase_carry", "no_q_wait")  # bugs a one-segment walk cannot show


def main(nseeds=None, mutation=None):
    """One " OK: " line per configuration without errors; returns the number with errors. mutation: see
    the docstring (every configuration must then report errors)."""
    if nseeds is None:
        nseeds = 200
    configs = []
    # (stages, seesaw order, the widening's slot groups per barrier): the short-split kernel's 4 x 32 tokens,
    # S first, three slots a step (widen_slots32<3>); the 64-token kernel's 2 x 64, tile a released before
    # S(b) (consume_two_stage<kSFirst = !kFp8 || kShort>), two slots a step and the RoPE slot alone.
    # TMA pages: the two stages of 64 only (the short-split kernel keeps cp.async).
    for ring, sfirst, groups in ((4, True, [(0, 1, 2), (3, 4, 5), (6, 7, 8)]),
                                 (2, False, [(0, 1), (2, 3), (4, 5), (6, 7), (8,)])):
        for tma in ((False, True) if ring == 2 else (False,)):
            if mutation in ("tma_no_bar",) and not tma or mutation in SCHEDULED_ONLY + ("no_end_bar",):
                continue
            configs.append((ring, sfirst, groups, tma, False, False))
    # The 16-bit kernels: two stages of 64, S first; uniform (one segment) and on the balanced schedule.
    for scheduled in (False, True):
        if mutation in (None, "early_release", "no_end_bar") or (mutation in SCHEDULED_ONLY and scheduled):
            configs.append((2, True, None, False, True, scheduled))
    bad = 0
    for ring, sfirst, groups, tma, b16, scheduled in configs:
        tag = f"ring={ring} kSFirst={sfirst}" + (" TMA" if tma else "") + (" 16-bit" if b16 else "")
        tag += " scheduled" if scheduled else ""
        if mutation is not None:
            tag += f" mutation={mutation}"

        def run(n, policy, seed):
            rng = random.Random(seed * 1000 + n)
            Sim(n, ring, sfirst, groups, rng, policy, mutation, tma, b16, segments_of(n, rng, scheduled)).run()

        bad += sweep(tag, run, range(1, 13), ("random", "producer_first", "math_first", "wg0_first", "wg1_first"), nseeds)
    return bad

if __name__ == "__main__":
    sys.exit(cli(main))
