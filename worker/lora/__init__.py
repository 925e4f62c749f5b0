"""LoRA adapters: PEFT-format loading (:mod:`.config`, :mod:`.adapter`), per-rank slots and
the mixed-batch forward (:mod:`.slots`), and per-replica LRU residency (:mod:`.residency`)."""
