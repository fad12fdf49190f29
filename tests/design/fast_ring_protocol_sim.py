"""Protocol simulation of the fp8 fast kernel (templates/mla/fp8_fast.cuh): the producer's four-stage ring
(produce), the math warpgroups' seesaw (consume: S of a tile by its owner, warpgroup t % 2, P^T stored
by the owner, P V by both) and the epilogue, which stages each warpgroup's O in ring stage wg once
every read of the ring is done.

Agents: the producer warpgroup (its 128 cp.async arrivals as one deferred event per tile, landing in
order at random times) and the two math warpgroups, each one agent (4 warp arrivals per release).
mbarriers and named barriers as in protocol_kit.py (the hardware parity rule, stale and lapped
phases). Data checks: every shared-memory region (the four ring stages, Q, the four P^T buffers, the
row_max / row_alpha hand-over buffers) holds a tag saying what was last written there; a read finds
the tag it expects (a tile, Q, its staged O, the pair's max), and a write or a landing copy finds no
unwaited wgmma read of the region. At the end every tile was read by its S and both P V, every
mbarrier is between phases and every named barrier between generations.

mutation= injects a bug the checks must catch (so the simulation can fail):
  early_release  a tile's owner releases its stage right after S, before its P V reads V
  no_end_bar     the epilogue skips its barriers (kBarEnd) before the row statistics and the staging

    python3 tests/design/fast_ring_protocol_sim.py [seeds per case, default 200] [--mutation=NAME]
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol_kit import MB, NB, Err, barrier_op, cli, step_one, sweep  # noqa: E402

STAGES = 4  # fp8_fast.cuh kStages
MUTATIONS = ("early_release", "no_end_bar")


class Sim:
    def __init__(s, n, rng, policy, mutation=None):
        assert mutation in (None,) + MUTATIONS, mutation
        s.n, s.rng, s.policy, s.mutation = n, rng, policy, mutation
        s.kv_full = [MB(f"kv_full[{i}]", 128) for i in range(STAGES)]
        s.kv_empty = [MB(f"kv_empty[{i}]", 8) for i in range(STAGES)]
        s.nb = {k: NB(k, 2) for k in ("Q", "MaxA", "PA", "MaxPB", "End")}
        s.tag = {}       # region -> what was last written there
        s.pending = {0: [], 1: []}  # warpgroup -> unwaited wgmma groups: [(regions, what)]
        s.reads = {}     # tile tag -> set of readers ("S", "PV0", "PV1")
        s.landing = []   # the producer's copies in flight, in order: (stage, tile tag)
        s.agents = {"producer": s.producer(), "wg0": s.math(0), "wg1": s.math(1)}

    # ---------------- the producer (produce)
    def producer(s):
        for t in range(s.n):
            st = t % STAGES
            yield ("wait", s.kv_empty[st], ((t // STAGES) & 1) ^ 1, t // STAGES, f"producer tile {t}")
            yield ("fill", st, ("kv", t))

    # ---------------- the math warpgroups (make_q, consume, the epilogue)
    def math(s, wg):
        yield ("write", wg, ["q"], ("Q",))  # make_q: each warpgroup rounds 32 of the rows
        yield ("nb_sync", s.nb["Q"], f"wg{wg}")
        for i in range((s.n + 1) // 2):
            a, b = 2 * i, 2 * i + 1
            sa, sb = a % STAGES, a % STAGES + 1
            has_b = b < s.n
            if wg == 0:
                yield from s.own_s(wg, a, sa)
                yield ("write", wg, ["rm0"], ("max", i))  # publish(0)
                yield ("nb_arrive", s.nb["MaxA"], "wg0")
                yield ("write", wg, [f"pt{sa}"], ("P", a))
                yield ("nb_arrive", s.nb["PA"], "wg0")
                yield from s.pv(wg, a, sa)
                if has_b:
                    yield ("nb_sync", s.nb["MaxPB"], "wg0")
                    yield ("read", wg, ["rm1"], ("max", i))  # follow(1)
                    yield from s.pv(wg, b, sb)
            else:
                yield ("nb_sync", s.nb["MaxA"], "wg1")
                yield ("read", wg, ["rm0"], ("max", i))  # follow(0)
                yield ("nb_sync", s.nb["PA"], "wg1")
                yield from s.pv(wg, a, sa)
                if has_b:
                    yield from s.own_s(wg, b, sb)
                    yield ("write", wg, ["rm1"], ("max", i))  # publish(1)
                    yield ("write", wg, [f"pt{sb}"], ("P", b))
                    yield ("nb_arrive", s.nb["MaxPB"], "wg1")
                    yield from s.pv(wg, b, sb)
        # The epilogue: row sums, warpgroup 0's final max into row_max[0], 1 / l into row_alpha[0] by the
        # first 64 math threads (warpgroup 0), then O staged in ring stage wg and copied out row by row.
        end = s.mutation != "no_end_bar"
        if end:
            yield ("nb_sync", s.nb["End"], f"wg{wg}")
        if wg == 0:
            yield ("write", wg, ["rm0"], ("final",))
        if end:
            yield ("nb_sync", s.nb["End"], f"wg{wg}")
        if wg == 0:
            yield ("read", wg, ["rm0"], ("final",))
            yield ("write", wg, ["ra0"], ("inv",))
        if end:
            yield ("nb_sync", s.nb["End"], f"wg{wg}")
        yield ("read", wg, ["ra0"], ("inv",))
        yield ("write", wg, [f"kv{wg}"], ("O", wg))
        yield ("read", wg, [f"kv{wg}"], ("O", wg))  # copy_staged_rows

    def own_s(s, wg, t, st):
        """own_s: wait for the tile, S = Q8 K8^T (a wgmma group over Q and the stage), wait."""
        yield ("wait", s.kv_full[st], (t // STAGES) & 1, t // STAGES + 1, f"wg{wg} S tile {t}")
        yield ("group", wg, [(f"kv{st}", ("kv", t)), ("q", ("Q",))], ("S", ("kv", t)))
        yield ("wgwait", wg)
        if s.mutation == "early_release":
            yield ("arrive", s.kv_empty[st], 4)

    def pv(s, wg, t, st):
        """pv: V^T by ldmatrix from the stage (synchronous), P^T by the wgmma, wait, release the stage."""
        yield ("read", wg, [f"kv{st}"], ("kv", t))
        yield ("group", wg, [(f"pt{st}", ("P", t))], (f"PV{wg}", ("kv", t)))
        yield ("wgwait", wg)
        if s.mutation != "early_release" or t % 2 != wg:
            yield ("arrive", s.kv_empty[st], 4)

    # ---------------- op execution: True if the op completed, False if it blocks
    def check_no_pending(s, regions, what):
        for wg, groups in s.pending.items():
            for regs, _ in groups:
                hit = set(regions) & {r for r, _ in regs}
                if hit:
                    raise Err(f"{what} writes {sorted(hit)} under warpgroup {wg}'s unwaited wgmma read")

    def check_tags(s, pairs, who):
        for region, want in pairs:
            if s.tag.get(region) != want:
                raise Err(f"{who} reads {region} expecting {want}, finds {s.tag.get(region)}")

    def try_op(s, name, op):
        done = barrier_op(op)
        if done is not None:
            return done
        k = op[0]
        if k == "fill":
            _, st, tile = op
            s.landing.append((st, tile))
            return True
        if k == "write":
            _, wg, regions, tag = op
            s.check_no_pending(regions, f"wg{wg}")
            for r in regions:
                s.tag[r] = tag
            return True
        if k == "read":
            _, wg, regions, tag = op
            s.check_tags([(r, tag) for r in regions], f"wg{wg}")
            if tag[0] == "kv":
                s.reads.setdefault(tag, set()).add(f"PV{wg}")
            return True
        if k == "group":
            _, wg, pairs, (reader, tile) = op
            s.check_tags(pairs, f"wg{wg} {reader}")
            s.pending[wg].append((pairs, (reader, tile)))
            return True
        if k == "wgwait":
            wg = op[1]
            for pairs, (reader, tile) in s.pending[wg]:
                s.check_tags(pairs, f"wg{wg} {reader} (at its wait)")
                if reader == "S":
                    s.reads.setdefault(tile, set()).add("S")
            s.pending[wg] = []
            return True
        raise Err(f"bad op {op}")

    def land(s):
        st, tile = s.landing.pop(0)
        s.check_no_pending([f"kv{st}"], f"the producer's copy of {tile}")
        s.tag[f"kv{st}"] = tile
        s.kv_full[st].arrive(128)

    def run(s, max_steps=10 ** 6):
        cur = {k: next(g) for k, g in s.agents.items()}
        done = set()
        for _ in range(max_steps):
            order = [k for k in s.agents if k not in done]
            if s.policy == "random":
                s.rng.shuffle(order)
            else:
                first = {"producer_first": "producer", "math_first": "wg", "wg0_first": "wg0", "wg1_first": "wg1"}[s.policy]
                order.sort(key=lambda k: (not k.startswith(first), s.rng.random()))
            progressed = False
            if s.landing and s.rng.random() < 0.3:
                s.land()
                progressed = True
            else:
                progressed = step_one(order, cur, s.agents, done, s.try_op)
                if not progressed and s.landing:
                    s.land()
                    progressed = True
            if len(done) == len(s.agents) and not s.landing:
                break
            if not progressed:
                blocked = {k: cur[k][-1] if cur[k][0] == "wait" else cur[k][:2] for k in s.agents if k not in done}
                raise Err(f"DEADLOCK: {blocked}")
        else:
            raise Err("too many steps")
        for t in range(s.n):
            got = s.reads.get(("kv", t), set())
            if got != {"S", "PV0", "PV1"}:
                raise Err(f"tile {t} read by {sorted(got)} only")
        for mb in s.kv_full + s.kv_empty:
            if mb.pending != mb.count:
                raise Err(f"{mb.name} ends with a partial phase ({mb.count - mb.pending} of {mb.count})")
        for nb in s.nb.values():
            if nb.arrived:
                raise Err(f"named barrier {nb.name} ends with arrivals of {sorted(nb.arrived)}")


def main(nseeds=None, mutation=None):
    """An " OK: " line if the kernel's protocol shows no error; returns 1 if it does, else 0."""
    nseeds = 200 if nseeds is None else nseeds
    tag = "fast" + (f" mutation={mutation}" if mutation else "")

    def run(n, policy, seed):
        Sim(n, random.Random(seed * 1000 + n), policy, mutation).run()

    return sweep(tag, run, range(1, 13), ("random", "producer_first", "math_first", "wg0_first", "wg1_first"), nseeds)


if __name__ == "__main__":
    sys.exit(cli(main))
