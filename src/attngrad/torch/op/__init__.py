"""The attention op: one description of a call and of every pass's fields (`call`), the
passes as PyTorch operators (`ops`) with their contract (`checks`), batching rules
(`vmap_rules`) and the autograd Functions over them (`autograd`); the registry that sends
each pass to a backend (`dispatch`); the rules every backend shares: dropout's keep-mask
(`dropout`), the sinks' lowering (`sink_logits`) and a key-constant bias's closed-form
gradient (`key_constant_bias`); and how a backend holds its tuning (`tuning`). Backends
import from here; nothing here imports a backend."""
