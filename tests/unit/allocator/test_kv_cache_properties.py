"""Property tests (hypothesis): random admit / grow / cache / fork / copy-on-write / free / publish
sequences keep every invariant of the KV cache manager.

The machine models the KV memory as a dict of slot writes keyed by ``(block id, offset)``: each
request writes its tokens through its own block table, and after every step every request must
read back exactly its own tokens through its table. That checks at once that prefix reuse
returns the right content, that eviction never hands out a referenced block, and that a forked
sibling never sees the other's writes (a writer unshares its last block with copy_on_write,
and the model runner's copy is modelled by copying the slots).
"""

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfleet.allocator.hashing import block_hash_chain
from kvfleet.allocator.kv_cache_manager import KVCacheManager, NoFreeBlocksError

BS = 4
NUM_BLOCKS = 12
ROOT = b"\x07" * 16
TOKENS = st.integers(0, 2)  # a small alphabet, so that prefixes are shared often


class KVCacheMachine(RuleBasedStateMachine):
    caching = True

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=self.caching)
        self.tokens: dict[str, list[int]] = {}      # request -> tokens written so far
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token stored there
        self.index: set[bytes] = set()              # a prefix index fed only by events
        self.counter = 0

    # ---- helpers -------------------------------------------------------------------------
    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _state(self):
        refs = [self.kv.ref_count(b) for b in range(NUM_BLOCKS)]
        tables = {r: self.kv.block_table(r) for r in self.tokens}
        return tables, refs, self.kv.num_free_blocks, self.kv.cached_hashes()

    def _slot(self, rid: str, pos: int) -> tuple[int, int]:
        return self.kv.block_table(rid)[pos // BS], pos % BS

    def _cache(self, rid: str) -> None:
        toks = self.tokens[rid]
        self.kv.cache_full_blocks(rid, block_hash_chain(ROOT, toks, BS), len(toks))

    def _pick(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    # ---- rules ---------------------------------------------------------------------------
    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=14))
    def admit(self, prompt):
        rid = self._new_id()
        computed = self.kv.get_computed_blocks(block_hash_chain(ROOT, prompt, BS), len(prompt))
        assert len(computed) <= (len(prompt) - 1) // BS
        before = self._state()
        new = self.kv.allocate_slots(rid, len(prompt), computed)
        if new is None:
            event("admit refused")
            assert rid not in self.kv and self._state() == before  # refused: nothing changed
            return
        if computed:
            event("prefix hit")
        table = self.kv.block_table(rid)
        assert table == list(computed) + new
        for pos in range(len(computed) * BS):    # reused blocks hold exactly this prefix
            assert self.slots[(table[pos // BS], pos % BS)] == prompt[pos]
        for pos in range(len(computed) * BS, len(prompt)):
            self.slots[(table[pos // BS], pos % BS)] = prompt[pos]
        self.tokens[rid] = list(prompt)
        self._cache(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(TOKENS, min_size=1, max_size=6))
    def grow(self, data, new_tokens):
        """Decode one token or prefill a chunk: unshare a partial last block, then write."""
        rid = self._pick(data)
        pos = len(self.tokens[rid])
        if pos % BS:
            before = self._state()
            try:
                cow = self.kv.copy_on_write(rid)
            except NoFreeBlocksError:
                assert self._state() == before
                return
            if cow:
                event("copy on write")
                ((src, dst),) = cow
                assert self.kv.ref_count(dst) == 1 and self.kv.ref_count(src) >= 1
                for offset in range(pos % BS):  # the model runner copies the block's KV
                    self.slots[(dst, offset)] = self.slots[(src, offset)]
        before = self._state()
        if self.kv.allocate_slots(rid, pos + len(new_tokens)) is None:
            assert self._state() == before
            return
        for i, token in enumerate(new_tokens):
            self.slots[self._slot(rid, pos + i)] = token
        self.tokens[rid].extend(new_tokens)
        self._cache(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent, child = self._pick(data), self._new_id()
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = self._pick(data)
        self.kv.free(rid)
        del self.tokens[rid]

    @rule()
    def publish(self):
        stored, removed = self.kv.take_events()
        if removed:
            event("evicted")
        assert not set(stored) & set(removed)
        self.index = (self.index - set(removed)) | set(stored)
        assert self.index == self.kv.cached_hashes()

    # ---- checks ----------------------------------------------------------------------------
    @invariant()
    def every_request_reads_back_its_own_tokens(self):
        self.kv.check_invariants()
        for rid, toks in self.tokens.items():
            table = self.kv.block_table(rid)
            assert len(table) == KVCacheManager.blocks_for(len(toks), BS)
            for pos, token in enumerate(toks):
                assert self.slots[(table[pos // BS], pos % BS)] == token, (rid, pos)

    def teardown(self):
        for rid in list(self.tokens):
            self.kv.free(rid)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == NUM_BLOCKS  # the pool's initial free count


class KVCacheMachineNoPrefixCaching(KVCacheMachine):
    caching = False


# Two cores and a whole suite under 10 minutes: enough runs to hit every path
# (prefix hit, eviction, copy-on-write, refusal; see --hypothesis-show-statistics).
KVCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40)
KVCacheMachineNoPrefixCaching.TestCase.settings = settings(max_examples=25, stateful_step_count=40)


TestKVCacheManagerProperties = KVCacheMachine.TestCase
TestKVCacheManagerNoPrefixCaching = KVCacheMachineNoPrefixCaching.TestCase


def test_a_write_without_copy_on_write_would_leak_to_the_sibling():
    """Negative control for the model above: sharing a partial block and writing in place is
    visible through the sibling's table; copy_on_write is what prevents it."""
    kv = KVCacheManager(4, BS)
    kv.allocate_slots("p", 2)
    kv.fork("p", "c")
    slots = {(kv.block_table("p")[0], 0): 1, (kv.block_table("p")[0], 1): 1}
    slots[(kv.block_table("p")[0], 2)] = 9                 # in-place write by the parent
    assert slots.get((kv.block_table("c")[0], 2)) == 9      # ... the child sees it
    ((src, dst),) = kv.copy_on_write("c")
    slots.update({(dst, o): slots[(src, o)] for o in range(2)})
    slots[(kv.block_table("c")[0], 2)] = 5                 # the child now writes privately
    assert slots[(kv.block_table("p")[0], 2)] == 9
    assert kv.block_table("p") != kv.block_table("c")
    kv.check_invariants()
