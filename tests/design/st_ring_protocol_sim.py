"""Host-side check of the transposed fp8 ring's barrier protocol with rotating stages (no GPU).

Models consume_st_regs / copy_fp8_tiles with kRing stages and W math warpgroups: tile t lives in stage
t % kRing and belongs to warpgroup t % W; the producer waits on the stage's "empty" barrier with parity
((t / kRing) & 1) ^ 1 before filling it, fills land in issue order (each producer thread's
cp.async.mbarrier.arrive.noinc tracks all its earlier copies), and a consumer waits on the "full"
barrier with parity (t / kRing) & 1, reads, then releases. mbarrier.try_wait.parity(p) passes iff the
barrier's current phase parity differs from p. Random interleavings check that no wait passes early
(a consumer reading another tile's data, a producer overwriting an unreleased stage) and that nothing
hangs, for 0..19 tiles and (kRing, W) = (4, 2), (4, 3) and (3, 2), the 32-row storage's; a ring
shallower than W (e.g. (2, 3) or (3, 4)) fails, which layouts.cuh's static_assert(kRing >= kMathWgs)
refuses.

The in-order landing is what the three-warpgroup mapping relies on: with W = 3 a warpgroup's next tile
t sits in a stage whose previous fill (tile t - 4) belongs to another warpgroup, and only the order of
the fills tells it that this fill has landed (its own previous tile t - 3 landed after it). With
fills landing in random order the check fails for W = 3 (a consumer passes on a stage two fills
behind); with W = 2 each warpgroup owns its stages and order does not matter. The hardware basis: a
cp.async.mbarrier.arrive.noinc fires once all of the thread's earlier cp.async copies are complete, so
a thread's arrival for tile t + 1 cannot precede its arrival for tile t.

    python3 tests/design/st_ring_protocol_sim.py
"""
import random


def simulate(num_tiles: int, wgs: int, ring: int = 4, seed: int = 0) -> None:
    rng = random.Random(seed)
    full = [0] * ring       # completed phases of each stage's "full" barrier
    empty = [0] * ring      # completed phases of each stage's "empty" barrier
    content = [None] * ring  # the tile whose bytes have landed in the stage
    pending = []            # issued fills, landing in order
    next_fill = 0
    tiles = [list(range(w, num_tiles, wgs)) for w in range(wgs)]
    reading = [False] * wgs
    done = steps = 0

    def passes(completed: int, parity: int) -> bool:
        return (completed & 1) != parity

    while done < num_tiles:
        steps += 1
        assert steps < 10**6, "hang"
        actions = (["fill"] if next_fill < num_tiles else []) + (["land"] if pending else [])
        actions += [w for w in range(wgs) if tiles[w]]
        a = rng.choice(actions)
        if a == "fill":
            t = next_fill
            s, f = t % ring, t // ring
            if passes(empty[s], (f & 1) ^ 1):
                assert f == 0 or empty[s] >= f, ("producer overwrote an unreleased stage", t)
                pending.append(t)
                next_fill += 1
        elif a == "land":
            t = pending.pop(0)
            content[t % ring] = t
            full[t % ring] += 1
        else:
            w = a
            t = tiles[w][0]
            s, f = t % ring, t // ring
            if not reading[w]:
                if passes(full[s], f & 1):
                    assert content[s] == t, ("consumer passed on another tile's data", t, content[s])
                    reading[w] = True
            else:
                empty[s] += 1
                tiles[w].pop(0)
                reading[w] = False
                done += 1


CONFIGS = ((4, 2), (4, 3), (3, 2))  # (kRing, math warpgroups) of SharedStorageStFp8's builds

if __name__ == "__main__":
    for ring, wgs in CONFIGS:
        for n in range(20):
            for seed in range(300):
                simulate(n, wgs, ring=ring, seed=seed)
    print("ring protocol: no early pass, no hang (rings x warpgroups 4x2, 4x3, 3x2; 0-19 tiles, 300 interleavings each)")
