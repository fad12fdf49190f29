"""What the protocol simulations of the 64-row path share (seesaw_protocol_sim.py, fast_ring_protocol_sim.py):
the barriers as they model them, the empty-barrier counts of consume_two_stage, one scheduling step, and
the sweep that runs one configuration over tile counts, scheduling policies and seeds and reports it."""
NSUB = 9  # slots of a KV tile (config.cuh kSubTiles)


class Err(Exception):
    """A protocol error one simulated run found (deadlock, stale phase, race, ...)."""


def empty_count(stage, slot):
    """two_stage_empty_count (consumer_rows64.cuh): the math warps that read a slot of a stage."""
    return 8 if slot == NSUB - 1 else (4 if slot // 4 == stage % 2 else 8)


class MB:
    """An mbarrier: `count` arrivals per phase."""

    def __init__(s, name, count):
        s.name, s.count, s.pending, s.phase = name, count, count, 0

    def arrive(s, n):
        s.pending -= n
        if s.pending < 0:
            raise Err(f"over-arrival on {s.name}")
        if s.pending == 0:
            s.phase += 1
            s.pending = s.count

    def try_wait(s, parity, want, what):
        """try_wait.parity: passes iff the current (incomplete) phase's index % 2 != parity. `want` is
        the count of completed phases the waiter means; passing at another count is a stale phase,
        blocking after it is a lapped one. True if it passes."""
        if s.phase % 2 != parity:
            if s.phase != want:
                raise Err(f"stale phase: {what} waited parity {parity} on {s.name}, wants {want} completed phases, "
                          f"has {s.phase}")
            return True
        if s.phase >= want:
            raise Err(f"lapped: {what} on {s.name} blocks although phase {want} done (has {s.phase})")
        return False


class NB:
    """A hardware named barrier; units are agents (each arrives once per generation)."""

    def __init__(s, name, expected):
        s.name, s.expected, s.arrived, s.gen = name, expected, set(), 0
        s.waiting = {}  # agent -> the generation it arrived in, while its bar.sync waits

    def sync(s, who):
        """bar.sync by `who`, one step: arrives on the first call; True once the generation completed."""
        if who not in s.waiting:
            s.waiting[who] = s.gen
            s.arrive(who)
        if s.gen > s.waiting[who]:
            del s.waiting[who]
            return True
        return False

    def arrive(s, who):
        if who in s.arrived:
            raise Err(f"{who} arrived twice in one generation of named barrier {s.name}")
        s.arrived.add(who)
        if len(s.arrived) == s.expected:
            s.arrived = set()
            s.gen += 1


def barrier_op(op):
    """The barrier ops every simulation shares: ("wait", mbarrier, parity, phase wanted, what), ("arrive",
    mbarrier, count) and ("nb_arrive" | "nb_sync", named barrier, who). True / False: done / blocked;
    None: not a barrier op (the simulation's own try_op handles it)."""
    k = op[0]
    if k == "wait":
        _, mb, parity, want, what = op
        return mb.try_wait(parity, want, what)
    if k in ("arrive", "nb_arrive"):
        op[1].arrive(op[2])
        return True
    if k == "nb_sync":
        return op[1].sync(op[2])
    return None


def step_one(order, cur, agents, done, try_op):
    """One step of a simulation: the first agent in `order` whose current op completes (try_op(name,
    op)) moves to its next op (or into `done`). True if one did."""
    for k in order:
        if try_op(k, cur[k]):
            try:
                cur[k] = next(agents[k])
            except StopIteration:
                done.add(k)
            return True
    return False


def cli(main):
    """A simulation's command line: [seeds per case] [--mutation=NAME] -> main(nseeds, mutation)'s result."""
    import sys
    args = sys.argv[1:]
    mut = [x.split("=", 1)[1] for x in args if x.startswith("--mutation=")]
    nums = [int(x) for x in args if not x.startswith("--")]
    return main(nums[0] if nums else None, mut[0] if mut else None)


def sweep(tag, run, tiles, policies, nseeds):
    """run(num_tiles, policy, seed) over every combination; prints "<tag> OK: ..." or the first five
    distinct errors with where they occurred; returns 1 if any run failed, else 0."""
    errs = {}
    for n in tiles:
        for policy in policies:
            for seed in range(nseeds):
                try:
                    run(n, policy, seed)
                except Err as e:
                    errs.setdefault(str(e)[:200], []).append((n, policy, seed))
    if not errs:
        print(tag, f"OK: num_tiles {tiles[0]}..{tiles[-1]}, {len(policies)} policies x", nseeds, "seeds")
        return 0
    print(tag, "ERRORS:")
    for e, where in list(errs.items())[:5]:
        print("   ", e, "e.g.", where[:3], f"({len(where)} runs)")
    return 1


def segments_of(n, rng, scheduled):
    """A simulated CTA's segments (tile counts): the uniform kernel's one of n tiles; on the balanced
    schedule 1-4 segments, the first of n - 1 tiles (so empty ones come first too), the others of 0-9."""
    if not scheduled:
        return [n]
    return [n - 1] + [rng.randrange(10) for _ in range(rng.randrange(4))]
