"""The transformers fallback: a model with no native family runs as its Hugging Face class,
whose attention layers call kvfleet's paged attention through transformers' attention
interface (``ALL_ATTENTION_FUNCTIONS``). The scheduler, block tables, prefix cache and KV
pool are kvfleet's as for a native family; only the layers' arithmetic is the class's own.

:mod:`.check` decides before anything starts whether a model can run so (torch-free until
it imports transformers); :mod:`.attention` is the registered function; :mod:`.model` builds
the class and adapts it to the runner's :class:`~kvfleet.worker.runner.models.CausalLM`;
:mod:`.tp` shards it by its ``base_model_tp_plan``; :mod:`.lora` wraps its linears by name.
Nothing on the native path imports this package (nor transformers).
"""
