"""Host-side check of the KV ring's barrier protocol under MLA_ST_SHARED (no GPU).

Models produce() and consume_st_shared (templates/mla/producer.cuh, consumer_st.cuh) slot by slot:
2 stages of 9 slots (8 latent, 1 RoPE); tile t in stage t % 2. The producer waits on each slot's
"empty" barrier with parity ((t / 2) & 1) ^ 1, then fills it; fills land in issue order and complete
the slot's "full" barrier (all producer threads' arrivals, one event here). Each of the two math
warpgroups takes every tile: it waits on the full barrier of every slot (parity (t / 2) & 1) for S^T,
then arrives on the empty barriers of the RoPE slot and of the other warpgroup's four latent slots,
reads its own four latent slots again for P V, and then arrives on those. A warpgroup's arrival is its
four warps' (weight 4); a slot's empty barrier completes a phase at kStSharedEmptyCount = 8 arrivals.
mbarrier.try_wait.parity(p) passes iff the barrier's completed-phase count has parity != p.

Random interleavings of the three agents check, for 0..11 tiles: no S^T or P V read sees a slot holding
another tile's bytes, no fill is issued (cp.async may write at once) over bytes a warpgroup still has
to read, and nothing hangs. Not modelled: P^T, col_stat and the end of the split (checked by review),
and fills landing out of order (each producer thread's arrive.noinc tracks all its earlier copies).

    python3 scripts/st_shared_protocol_sim.py
"""
import random

STAGES, SLOTS, HALF = 2, 9, 4
EMPTY_COUNT = 8  # consumer_st.cuh kStSharedEmptyCount
WARPS_PER_WG = 4


def simulate(num_tiles: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    n = STAGES * SLOTS
    full = [0] * n          # completed phases of each slot's full barrier
    empty = [0] * n         # completed phases of each slot's empty barrier
    empty_pending = [0] * n  # arrivals towards the empty barrier's current phase
    content = [None] * n    # the tile whose bytes are in the slot
    needed = [set() for _ in range(n)]  # (wg, tile) readers that still have to read the slot
    pending = []            # issued fills (slot, tile), landing in order
    prod = [0, 0]           # producer: next (tile, slot)
    # Each warpgroup: tile, phase ("s" waiting slot k for S^T, "pv" reading its half), next slot.
    cons = [{"t": 0, "phase": "s", "k": 0} for _ in range(2)]

    def passes(completed: int, parity: int) -> bool:
        return (completed & 1) != parity

    def arrive(slot: int) -> None:
        empty_pending[slot] += WARPS_PER_WG
        assert empty_pending[slot] <= EMPTY_COUNT, ("more arrivals than the phase expects", slot)
        if empty_pending[slot] == EMPTY_COUNT:
            empty_pending[slot] = 0
            empty[slot] += 1

    def slot_of(t: int, k: int) -> int:
        return (t % STAGES) * SLOTS + k

    steps = 0
    while not (prod[0] >= num_tiles and not pending and all(c["t"] >= num_tiles for c in cons)):
        steps += 1
        assert steps < 10**6, "hang"
        actions = []
        if prod[0] < num_tiles:
            actions.append("fill")
        if pending:
            actions.append("land")
        actions += [w for w in range(2) if cons[w]["t"] < num_tiles]
        if not actions:
            raise AssertionError("hang: nothing can move")
        a = rng.choice(actions)
        if a == "fill":
            t, k = prod
            slot = slot_of(t, k)
            if passes(empty[slot], ((t // STAGES) & 1) ^ 1):
                # cp.async may write the slot any time after issue: nobody may still need its bytes.
                assert not needed[slot], ("a fill was issued over bytes still to be read", slot, t, needed[slot])
                pending.append((slot, t))
                prod[1] += 1
                if prod[1] == SLOTS:
                    prod[0], prod[1] = prod[0] + 1, 0
        elif a == "land":
            slot, t = pending.pop(0)
            assert not needed[slot], ("a fill landed over bytes still to be read", slot, t, needed[slot])
            content[slot] = t
            needed[slot] = {(0, t), (1, t)}
            full[slot] += 1
        else:
            w = a
            c = cons[w]
            t = c["t"]
            if c["phase"] == "s":
                slot = slot_of(t, c["k"])
                if passes(full[slot], (t // STAGES) & 1):
                    assert content[slot] == t, ("S^T read another tile's bytes", w, t, c["k"], content[slot])
                    if not (w * HALF <= c["k"] < (w + 1) * HALF):
                        needed[slot].discard((w, t))  # S^T is this warpgroup's last read of the slot
                    c["k"] += 1
                    if c["k"] == SLOTS:
                        # S^T done: release the RoPE slot and the other warpgroup's half.
                        arrive(slot_of(t, SLOTS - 1))
                        for k in range((1 - w) * HALF, (2 - w) * HALF):
                            arrive(slot_of(t, k))
                        c["phase"] = "pv"
            else:
                for k in range(w * HALF, (w + 1) * HALF):  # P V reads this warpgroup's half again
                    slot = slot_of(t, k)
                    assert content[slot] == t, ("P V read another tile's bytes", w, t, k, content[slot])
                    needed[slot].discard((w, t))
                for k in range(w * HALF, (w + 1) * HALF):
                    arrive(slot_of(t, k))
                c["t"], c["phase"], c["k"] = t + 1, "s", 0


if __name__ == "__main__":
    for tiles in range(12):
        for seed in range(300):
            simulate(tiles, seed=seed)
    print("MLA_ST_SHARED ring protocol: no early read, no overwrite of unread bytes, no hang "
          "(0-11 tiles, 300 interleavings each)")
