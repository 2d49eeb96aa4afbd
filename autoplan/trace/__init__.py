"""Stage 1, trace: run the model once on fake tensors and record its joint forward+backward ATen graph,
every node tagged with the module path and phase it came from, so the later stages plan over one
static graph without real memory or a cluster. Here too is what the graph alone tells: how
``input_fn``'s value becomes the model's call, which layers are identical repeats (traced once and
stamped, then planned once), which forward values a layer may recompute in backward, what each
attention kernel's arguments are, and a tracing failure named by op, module and model line."""
