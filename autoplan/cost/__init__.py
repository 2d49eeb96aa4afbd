"""Stage 3, cost: what each sharding choice costs on the target devices, without running it: roofline
compute from FLOPs, the seconds of each redistribution's collectives on the mesh's network, the
communication that hides under compute, and the bytes a training step keeps alive per device with
their peak. These prices are the ILP's coefficients and rows; the planning host is a CPU, so every
number describes the target accelerators named by a device profile."""
