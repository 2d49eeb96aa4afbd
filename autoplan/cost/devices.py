"""Target device profiles: the performance facts the cost model prices a plan with.

The planning host is a CPU; every number here describes the *target* accelerators, so nothing is
read from local devices. Each profile names its public source. Rates are per GPU, dense (no
sparsity); link bandwidths are per direction.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from autoplan.errors import ConstraintError


class LinkKind(enum.Enum):
    INTRA_NODE = "nvlink"
    INTER_NODE = "network"


@dataclass(frozen=True)
class DeviceProfile:
    """Performance facts of one target accelerator model and its interconnect (all rates per device)."""

    name: str
    peak_flops: tuple[tuple[str, float], ...]  # (dtype name, dense FLOP/s); a tuple so the profile stays hashable
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per device per direction (NVLink/NVSwitch, Infinity Fabric)
    inter_node_bandwidth: float  # bytes/s per device per direction (its own NIC)
    intra_node_latency: float  # s per collective step
    inter_node_latency: float  # s per collective step
    gpus_per_node: int
    memory_bytes: int
    compute_efficiency: float  # achievable fraction of peak FLOPs
    bandwidth_efficiency: float  # achievable fraction of HBM / link bandwidth
    kernel_launch: float  # floor per launched kernel, s
    nvls: bool = False  # the node's switch reduces in-network (NVLink SHARP): all-reduce moves each byte once
    # measured (``autoplan calibrate``): (kernel kind, dtype name, FLOPs of one kernel, fraction of the
    # dtype's peak it reaches[, its thinness]), by size, per kind ("matmul"; "attention": SDPA kernels)
    # and dtype; rows of several thinnesses make one curve each (``thinness``: a thin matmul reaches
    # less of the peak than a square one of the same FLOPs); empty: every kernel reaches
    # ``compute_efficiency``
    kernel_efficiency: tuple[tuple, ...] = ()
    # the fraction of a hideable collective's time that runs under compute: 1 where collectives have
    # their own stream or engine (NCCL); measured by ``autoplan calibrate`` where they compete with
    # compute for the same cores (gloo's threads on a small CPU)
    comm_overlap: float = 1.0
    # measured (``autoplan calibrate``): per collective kind, the (latency s, bandwidth bytes/s) it
    # runs at over the intra-node link, fitted to the model's formula for it, where the backend runs
    # it otherwise than the model (gloo's reduce-scatter reduces the whole tensor, its all-reduce pays
    # more per step); a kind not listed takes the link's own figures
    collective_links: tuple[tuple[str, float, float], ...] = ()
    # how much longer than one rank's compute a step of several ranks waits for it: ranks given the
    # same work finish it apart (cores shared with other ranks and the backend's threads), and each
    # blocking collective waits for the last; a fraction of the compute, measured by ``autoplan
    # calibrate`` on a backend that shares the compute's cores (gloo), 0 in the datasheet profiles
    rank_skew: float = 0.0

    def __post_init__(self) -> None:
        for (kind, dtype), levels in self._curves.items():
            for thin, points in levels:
                if (
                    kind not in KERNEL_KINDS
                    or not thin > 0
                    or any(f <= 0 or not 0 < e <= 1 for f, e in points)
                    or points != tuple(sorted(points))
                ):
                    raise ValueError(
                        f"profile {self.name!r}: kernel_efficiency of ({kind!r}, {dtype!r}) must be (FLOPs > 0,"
                        f" fraction in (0, 1][, thinness > 0]) rows in increasing FLOPs per thinness for a kind"
                        f" in {KERNEL_KINDS}, got {points} at thinness {thin}"
                    )
        if not 0 <= self.comm_overlap <= 1:
            raise ValueError(f"profile {self.name!r}: comm_overlap is a fraction in [0, 1], got {self.comm_overlap}")
        if not 0 <= self.rank_skew <= 1:
            raise ValueError(f"profile {self.name!r}: rank_skew is a fraction in [0, 1], got {self.rank_skew}")
        if any(k not in COLLECTIVE_KINDS or not (lat > 0 and bw > 0) for k, lat, bw in self.collective_links):
            raise ValueError(
                f"profile {self.name!r}: collective_links takes (kind in {COLLECTIVE_KINDS}, latency > 0,"
                f" bandwidth > 0) rows, got {self.collective_links}"
            )

    @functools.cached_property
    def _kind_links(self) -> dict[str, tuple[float, float]]:
        return {kind: (latency, bandwidth) for kind, latency, bandwidth in self.collective_links}

    @functools.cached_property
    def _curves(self) -> dict[tuple[str, str], tuple[tuple[float, tuple[tuple[float, float], ...]], ...]]:
        """(kind, dtype name) -> its curves as (thinness, (FLOPs, fraction) points), in increasing
        thinness; rows without a thinness make one curve, of square kernels (thinness 1)."""
        curves: dict[tuple[str, str], dict[float, list[tuple[float, float]]]] = {}
        for kind, dtype, flops, fraction, *rest in self.kernel_efficiency:
            curves.setdefault((kind, dtype), {}).setdefault(rest[0] if rest else 1.0, []).append((flops, fraction))
        return {k: tuple((t, tuple(v[t])) for t in sorted(v)) for k, v in curves.items()}

    def curve_for(self, kind: str, dtype: torch.dtype) -> tuple[tuple[float, float], ...]:
        """The measured (FLOPs, fraction) points of ``kind`` kernels in ``dtype`` at their least
        measured thinness (square matmuls)."""
        levels = self.curves_for(kind, dtype)
        return levels[0][1] if levels else ()

    def curves_for(self, kind: str, dtype: torch.dtype) -> tuple[tuple[float, tuple[tuple[float, float], ...]], ...]:
        """The measured curves of ``kind`` kernels in ``dtype``, as (thinness, (FLOPs, fraction)
        points) in increasing thinness. A dtype not measured takes the curves of the measured one
        whose peak rate is nearest (fp8 those of bf16, say); a kind not measured, the matmul's;
        nothing measured, none."""
        found = self._curve_memo.get((kind, dtype))
        if found is None:
            found = self._curve_memo[kind, dtype] = self._find_curves(kind, dtype)
        return found

    @functools.cached_property
    def _curve_memo(self) -> dict:
        return {}

    def _find_curves(self, kind: str, dtype: torch.dtype) -> tuple:
        for k in (kind, "matmul"):
            measured = {d: c for (kk, d), c in self._curves.items() if kk == k}
            if measured:
                if dtype_name(dtype) in measured:
                    return measured[dtype_name(dtype)]
                rate = math.log(self.flops_for(dtype))
                nearest = min(sorted(measured), key=lambda d: abs(math.log(self.flops_for(_dtype(d))) - rate))
                return measured[nearest]
        return ()

    def efficiency_at(
        self, flops: float, dtype: torch.dtype = torch.float32, kind: str = "matmul", thinness: float = 1.0
    ) -> float:
        """The fraction of the peak a ``kind`` kernel of ``flops`` in ``dtype`` and ``thinness``
        (``thinness``) reaches: ``compute_efficiency`` times the measured curves, linear in log
        FLOPs along each curve and in log thinness between the curves around ``thinness``, flat past
        the ends of both."""
        levels = self.curves_for(kind, dtype)
        if not levels:
            return self.compute_efficiency
        thins = [t for t, _ in levels]
        j = bisect.bisect_left(thins, thinness)
        if j == len(levels) or thins[j] == thinness or j == 0:
            fraction = _along(levels[min(j, len(levels) - 1)][1], flops)
        else:
            (lo, low), (hi, high) = levels[j - 1], levels[j]
            t = (math.log(thinness) - math.log(lo)) / (math.log(hi) - math.log(lo))
            fraction = _along(low, flops) + t * (_along(high, flops) - _along(low, flops))
        return self.compute_efficiency * fraction

    def flops_for(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype``; unlisted dtypes (ints, bool, complex) get the slowest listed rate, to be safe."""
        rates = dict(self.peak_flops)
        return rates.get(dtype_name(dtype), min(rates.values()))

    def link_bandwidth(self, link: LinkKind, kind: str | None = None) -> float:
        """Achievable bytes/s per device on ``link`` for a ``kind`` collective (``collective_links``)."""
        if link is LinkKind.INTRA_NODE:
            raw = self._kind_links[kind][1] if kind in self._kind_links else self.intra_node_bandwidth
        else:
            raw = self.inter_node_bandwidth
        return raw * self.bandwidth_efficiency

    def link_latency(self, link: LinkKind, kind: str | None = None) -> float:
        if link is LinkKind.INTRA_NODE:
            return self._kind_links[kind][0] if kind in self._kind_links else self.intra_node_latency
        return self.inter_node_latency


def thinness(flops: float, nbytes: float, itemsize: int) -> float:
    """How much more a kernel of ``flops`` reads and writes (``nbytes``) than a square matmul of the
    same FLOPs would: 1 for a square (n, n, n) matmul, which moves the fewest bytes for its FLOPs;
    5/3 for an (n/8, n, n) one, at any n. A scale-free measure of shape that predicts how much of
    the peak a matmul reaches besides its size."""
    side = (flops / 2) ** (1 / 3)
    return max(nbytes / (3 * itemsize * side * side), 1.0) if flops > 0 else 1.0


def _along(curve: tuple[tuple[float, float], ...], flops: float) -> float:
    """A curve's fraction at ``flops``: linear in log FLOPs between its points, flat past its ends."""
    xs = [math.log(f) for f, _ in curve]
    x = math.log(max(flops, 1.0))
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return curve[0][1]
    if i == len(xs):
        return curve[-1][1]
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return curve[i - 1][1] + t * (curve[i][1] - curve[i - 1][1])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


KERNEL_KINDS = ("matmul", "attention")
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


# NVIDIA H100 SXM5 80GB. Source: NVIDIA H100 Tensor Core GPU datasheet (dense figures are half the
# "with sparsity" ones): bf16/fp16 989 TFLOPS, fp8 1979, fp64 67; HBM3 3.35 TB/s; NVLink 4 900 GB/s
# both directions; DGX H100: one 400 Gb/s ConnectX-7 NIC per GPU. float32 is the CUDA-core rate, not
# TF32: PyTorch's default float32_matmul_precision="highest" keeps fp32 matmuls off tensor cores.
# Efficiencies: large bf16 GEMMs reach ~60 % of peak, HBM/NVLink/network streams ~80 %. Latencies:
# ~5 us per NCCL step over NVSwitch, ~15 us over InfiniBand/RoCE; ~4 us per kernel launch. The
# third-generation NVSwitch reduces in the switch (NVLS), which NCCL uses for intra-node all-reduce.
H100_SXM = DeviceProfile(
    name="H100-SXM5-80GB",
    peak_flops=(
        ("float8_e4m3fn", 1979e12),
        ("float8_e5m2", 1979e12),
        ("bfloat16", 989e12),
        ("float16", 989e12),
        ("float32", 67e12),
        ("float64", 67e12),
    ),
    hbm_bandwidth=3.35e12,
    intra_node_bandwidth=450e9,
    inter_node_bandwidth=50e9,
    intra_node_latency=5e-6,
    inter_node_latency=15e-6,
    gpus_per_node=8,
    memory_bytes=80 * 2**30,
    compute_efficiency=0.6,
    bandwidth_efficiency=0.8,
    kernel_launch=4e-6,
    nvls=True,
)
# The kernels of one H200 SXM as ``autoplan calibrate --device cuda`` measured them (2026-11-28, torch
# 2.11, cuBLAS and SDPA's flash kernel), as fractions of the datasheet peak: matmuls of (n/r, n, n) at
# n = 128, 256, ..., 8192, per (dtype, r); causal attention of 16 heads of 128 at sequence 512, 2048 and
# 8192, per dtype. Large bf16 GEMMs reach 0.79 of the 989 TFLOPS, not the 0.6 guessed for the H100;
# small ones are bound by their launch (about 11 us a call through PyTorch there).
_H200_MATMUL = {
    ("float32", 1): (0.00459, 0.0286, 0.235, 0.562, 0.748, 0.754, 0.759),
    ("float32", 8): (0.000148, 0.00482, 0.034, 0.27, 0.589, 0.673, 0.762),
    ("float32", 32): (0.000124, 0.00109, 0.00858, 0.0701, 0.386, 0.668, 0.687),
    ("bfloat16", 1): (0.000326, 0.0022, 0.0155, 0.124, 0.705, 0.789, 0.777),
    ("bfloat16", 8): (3.05e-05, 0.000261, 0.00192, 0.0162, 0.134, 0.707, 0.789),
    ("bfloat16", 32): (1.07e-05, 6.48e-05, 0.000482, 0.00412, 0.033, 0.261, 0.653),
    ("float16", 1): (0.000343, 0.00273, 0.0217, 0.165, 0.694, 0.757, 0.757),
    ("float16", 8): (4.29e-05, 0.000353, 0.00281, 0.0227, 0.171, 0.675, 0.71),
    ("float16", 32): (1.08e-05, 8.7e-05, 0.000684, 0.00574, 0.0417, 0.308, 0.625),
}
_H200_ATTENTION = {
    "float32": (0.212, 0.386, 0.564),
    "bfloat16": (0.0168, 0.271, 0.523),
    "float16": (0.0257, 0.248, 0.505),
}
_H200_ATTENTION_FLOPS = (3.758e9, 6.013e10, 9.621e11)  # 3.5 x sdpa_flops: a forward and its backward


def _h200_curves() -> tuple[tuple, ...]:
    """``kernel_efficiency`` rows of the H200's measured tables, each matmul at its ``thinness``."""
    rows: list[tuple] = []
    for (dtype, r), fractions in _H200_MATMUL.items():
        sizes = [128 << i for i in range(7)]
        flops = [2.0 * (n // r) * n * n for n in sizes]
        # one thinness for the family, at any size: one curve (calibrate rounds it the same way)
        thin = round(thinness(flops[-1], 2 * (2 * (sizes[-1] // r) * sizes[-1] + sizes[-1] ** 2), 2), 3)
        rows += [("matmul", dtype, f, e, thin) for f, e in zip(flops, fractions, strict=True)]
    for dtype, fractions in _H200_ATTENTION.items():
        rows += [("attention", dtype, f, e) for f, e in zip(_H200_ATTENTION_FLOPS, fractions, strict=True)]
    return tuple(rows)


# NVIDIA H200 SXM. Source: NVIDIA H200 Tensor Core GPU datasheet: the H100's compute and NVLink 4
# with 141 GB of HBM3e at 4.8 TB/s; its kernels as measured (``_H200_MATMUL``, ``_H200_ATTENTION``).
H200_SXM = dataclasses.replace(
    H100_SXM,
    name="H200-SXM-141GB",
    hbm_bandwidth=4.8e12,
    memory_bytes=141 * 10**9,
    compute_efficiency=1.0,
    kernel_efficiency=_h200_curves(),
)
# NVIDIA A100 SXM4 80GB. Source: NVIDIA A100 Tensor Core GPU datasheet: bf16 312 TFLOPS dense,
# fp32 19.5; HBM2e 2,039 GB/s; NVLink 3 600 GB/s both directions (second-generation NVSwitch: no
# in-switch reduction); DGX A100: one 200 Gb/s HDR NIC per GPU. No fp8.
A100_SXM = dataclasses.replace(
    H100_SXM,
    name="A100-SXM4-80GB",
    peak_flops=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12), ("float64", 19.5e12)),
    hbm_bandwidth=2.039e12,
    intra_node_bandwidth=300e9,
    inter_node_bandwidth=25e9,
    nvls=False,
)
# NVIDIA B200 in HGX B200 (1,000 W). Source: NVIDIA HGX B200 datasheet (per-GPU dense figures):
# fp8 4.5 PFLOPS, bf16/fp16 2.25, fp32 80 TFLOPS, fp64 40; 180 GB HBM3e at 8 TB/s; NVLink 5
# 1.8 TB/s both directions through NVLink-5 switches (NVLS); DGX B200: one 400 Gb/s ConnectX-7 per GPU.
B200 = dataclasses.replace(
    H100_SXM,
    name="B200-HGX-180GB",
    peak_flops=(
        ("float8_e4m3fn", 4500e12),
        ("float8_e5m2", 4500e12),
        ("bfloat16", 2250e12),
        ("float16", 2250e12),
        ("float32", 80e12),
        ("float64", 40e12),
    ),
    hbm_bandwidth=8e12,
    intra_node_bandwidth=900e9,
    memory_bytes=180 * 10**9,
)
# AMD Instinct MI300X (OAM, 750 W). Source: AMD Instinct MI300X data sheet: bf16/fp16 1,307.4 TFLOPS
# dense, fp8 2,614.9, fp32 matrix 163.4, fp64 81.7; 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric links
# of 128 GB/s (both directions) to the node's 7 peers, fully connected: RCCL drives all seven at once,
# 7 x 64 GB/s per direction. No in-network reduction. Platforms pair each GPU with a 400 Gb/s NIC.
MI300X = dataclasses.replace(
    H100_SXM,
    name="MI300X-OAM-192GB",
    peak_flops=(
        ("float8_e4m3fnuz", 2614.9e12),
        ("float8_e5m2fnuz", 2614.9e12),
        ("bfloat16", 1307.4e12),
        ("float16", 1307.4e12),
        ("float32", 163.4e12),
        ("float64", 81.7e12),
    ),
    hbm_bandwidth=5.3e12,
    intra_node_bandwidth=7 * 64e9,
    intra_node_latency=8e-6,
    memory_bytes=192 * 10**9,
    compute_efficiency=0.45,  # public MI300X GEMM measurements reach well below the datasheet peak
    nvls=False,
)
# A CPU host running gloo (the CI and test meshes), for pricing plans that run there, not a target.
# Source: one socket of a current x86 server (32 cores x 2 AVX-512 FMA units x 16 fp32 lanes x 2 FLOPs
# at ~2 GHz ~ 4 TFLOPS fp32; bf16 has no faster path in PyTorch's CPU GEMMs), 8 channels of DDR5-4800
# (307 GB/s); gloo moves tensors over TCP: loopback on one host (~10 GB/s), 100 GbE between hosts.
# Latencies are gloo's per-step TCP round trips; an op dispatch costs ~10 us of Python and ATen.
CPU_GLOO = DeviceProfile(
    name="cpu-gloo",
    peak_flops=(("bfloat16", 4e12), ("float16", 4e12), ("float32", 4e12), ("float64", 2e12)),
    hbm_bandwidth=307e9,
    intra_node_bandwidth=10e9,
    inter_node_bandwidth=12.5e9,
    intra_node_latency=30e-6,
    inter_node_latency=60e-6,
    gpus_per_node=64,
    memory_bytes=256 * 2**30,
    compute_efficiency=0.5,
    bandwidth_efficiency=0.7,
    kernel_launch=10e-6,
)
DEVICE_PROFILES = {
    "h100": H100_SXM,
    "h200": H200_SXM,
    "a100": A100_SXM,
    "b200": B200,
    "mi300x": MI300X,
    "cpu": CPU_GLOO,
}


PROFILE_FORMAT = "autoplan-device-profile"
# 2: kernel_efficiency per kind and dtype (1 had one matmul curve for every dtype); 3: collective_links
# and kernel_efficiency rows with a thinness; 4: rank_skew
PROFILE_VERSION = 4


def profile_to_json(profile: DeviceProfile, measured: dict | None = None) -> str:
    """The versioned JSON of a profile, with what was measured to make it (``autoplan calibrate``)."""
    fields = {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile)}
    doc = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "profile": fields, "measured": measured or {}}
    return json.dumps(doc, indent=1)


def profile_from_json(path: str | Path) -> DeviceProfile:
    """A profile written by ``profile_to_json``; another format, another version or an unknown
    field is refused by name."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ConstraintError(f"{path}: not an autoplan device profile (no 'format': {PROFILE_FORMAT!r})")
    if data.get("version") not in range(1, PROFILE_VERSION + 1):
        raise ConstraintError(
            f"{path}: device profile version {data.get('version')}; this autoplan reads versions 1 to {PROFILE_VERSION}"
        )
    fields = data.get("profile")
    if not isinstance(fields, dict):
        raise ConstraintError(f"{path}: a device profile file needs a 'profile' object")
    if data["version"] == 1:  # its one matmul curve stood for every dtype
        fields = dict(fields)
        curve = fields.pop("matmul_efficiency", ())
        fields["kernel_efficiency"] = [("matmul", d, f, e) for d, _ in fields.get("peak_flops", ()) for f, e in curve]
    known = {f.name: f for f in dataclasses.fields(DeviceProfile)}
    unknown = sorted(set(fields) - set(known))
    missing = sorted(k for k, f in known.items() if k not in fields and f.default is dataclasses.MISSING)
    if unknown or missing:
        raise ConstraintError(f"{path}: device profile fields unknown {unknown}, missing {missing}")
    fields = dict(fields)
    for key in ("peak_flops", "kernel_efficiency", "collective_links"):
        fields[key] = tuple(tuple(row) for row in fields.get(key, ()))
    try:
        return DeviceProfile(**fields)
    except ValueError as e:
        raise ConstraintError(f"{path}: {e}") from None


def resolve_profile(profile: str | Path | DeviceProfile) -> DeviceProfile:
    """A profile given by name (``"h200"``, case-insensitive), by the path of a profile JSON
    (``autoplan calibrate --out``), or passed in as is."""
    if isinstance(profile, DeviceProfile):
        return profile
    if isinstance(profile, str) and profile.lower() in DEVICE_PROFILES:
        return DEVICE_PROFILES[profile.lower()]
    if isinstance(profile, (str, Path)) and str(profile).endswith(".json"):
        if not Path(profile).is_file():
            raise ConstraintError(f"no device profile file {str(profile)!r} (autoplan calibrate writes one)")
        return profile_from_json(profile)
    raise ConstraintError(
        f"unknown device profile {profile!r}: use one of {', '.join(sorted(DEVICE_PROFILES))}, "
        "the path of a profile JSON (autoplan calibrate --out) or an autoplan.DeviceProfile"
    )
