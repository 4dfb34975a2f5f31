"""What the CarryStore tests share: an entry, a deposit through admit + put, the keys held,
an all-causes eviction count and a settable clock."""

from trtllm_mtp_carry import EVICTION_CAUSES, CarriedDrafter, CarryStore


def entry(key: int, rows: int = 3, blocks: tuple[int, ...] = (0,)) -> CarriedDrafter:
    """An entry of `rows` compacted rows (keys 0..rows-1) over tokens 100.. of session `key`."""
    return CarriedDrafter(blocks, rows, rows - 1, list(range(100, 100 + rows + 1)), key)


def deposit(store: CarryStore, key: int, nbytes: int = 10, session: int | None = None,
            rows: int = 3) -> list[int] | None:
    """Admit and put `key`'s entry: the keys evicted to make room, or None if refused."""
    evicted = store.admit(key, nbytes, session)
    if evicted is None:
        return None
    store.put(entry(key, rows), nbytes, session)
    return [e.session_hash for e in evicted]


def keys(store: CarryStore) -> list[int]:
    return [e.session_hash for e in store.entries()]


def zeros(**counts: int) -> dict[str, int]:
    """`store.evictions()` as it reads with only `counts` non-zero."""
    return {cause: counts.get(cause, 0) for cause in EVICTION_CAUSES}


class Clock:
    """A store clock the test moves by setting `now`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
