"""The Triton kernels compiled for real GPUs, without one, and what their machine code does.

Triton compiles for a GPU target with no GPU present (triton.compile(ASTSource(...), target=
GPUTarget(...))): PTX, then a cubin by the ptxas that Triton ships, for NVIDIA; AMDGCN, then an
hsaco by the LLVM linker inside Triton, for AMD. Every variant of kernels.triton_noise.kernel_specs(),
with the argument types and constexprs its launcher passes (FP32 w on every target; the BF16 and
FP16 w the launchers also accept on sm_90), is compiled for sm_80 (A100), sm_90 (H100), sm_100
(B200) and gfx942 (MI300) with the runtime's specialisation of the launcher's call on a weight of
Llama2-134M (2048 x 768): every pointer 16-byte aligned (as torch allocates), the int arguments
that are multiples of 16 marked so (n = 768, n / 8 = 96, not nbn = 24); the `_unaligned` variants
on 2048 x 770.
Any compile error fails.

Then the properties of a memory-bound kernel are read from the code, per thread (the kernels have
no loops, so each instruction in the code runs once per thread):
  - no local memory: no `.local` in the PTX, no stack or local memory in the cubin (where ptxas's
    register spills go), no scratch and no spilled registers in the AMDGCN;
  - the main streams (w or g, R, out) move in the widest vector accesses, and exactly as many as
    their bytes need; the only other global accesses are one block scale per thread and one
    block-sum store.
Compiling takes a while, so it is done once per session, in one subprocess (the tests import
Triton in interpreter mode, which cannot compile), and Triton's on-disk cache keeps the results.
"""
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"sm_80": ("cuda", 80, 32), "sm_90": ("cuda", 90, 32), "sm_100": ("cuda", 100, 32),
           "gfx942": ("hip", "gfx942", 64)}
VECTOR_BYTES = 16  # the widest global load/store of a thread: ld.global.v4.b32, global_load_dwordx4


MODEL_SHAPE = (2048, 768)  # Llama2-134M's mlp.up and mlp.gate weight: (ffn_hidden, n_embd)


def call_shape(variant, shape=MODEL_SHAPE):
    """The weight of the launcher's call: `shape`, two more columns for the `_unaligned` variants (n not a
    multiple of 8 for gaussws, of 4 for diffq's one pass)."""
    return shape[0], shape[1] + (2 if "unaligned" in variant else 0)


def call_ints(variant, shape=MODEL_SHAPE):
    """The int arguments of the launcher's call on a w of `shape` (call_shape)."""
    m, n = call_shape(variant, shape)
    return {"m": m, "n": n, "n_words_row": n // 8, "nbn": -(-n // 32), "n_words": m * n // 8, "numel": m * n}


def call_constexprs(spec, variant, w_type, shape=MODEL_SHAPE):
    """The constexprs of the call: the spec's, and for the many kernels the per-call ones, as the launcher
    gives them for a group of weights of `shape` and type w_type (kernels.triton_noise._hints)."""
    from kernels import triton_noise
    if not spec.per_call:
        return dict(spec.constexprs)
    w_dtype = dict(zip(W_BYTES, triton_noise.PER_CALL["W_DTYPE"]))[w_type]
    return {**spec.constexprs, "W_DTYPE": w_dtype, **triton_noise._hints(*call_shape(variant, shape))}


def reductions(ttgir):
    """[(axis, operand type with its layout written out)] of every tt.reduce of a kernel's TTGIR: the
    layout fixes which elements each thread sums first and how threads and warps combine them."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    out = []
    for m in re.finditer(r'"tt\.reduce"\(%[\w.#]+\) <\{axis = (\d+) : i32\}>', ttgir):
        start = ttgir.index("}) : (", m.end()) + len("}) : (")
        operand = ttgir[start:ttgir.index(") ->", start)]
        out.append((int(m.group(1)), re.sub(r"#blocked\d*\b", lambda a: layouts[a.group(0)], operand)))
    return out


def _arg_types(spec, w_type):
    """The signature of one compile: w/g as `w_type` where the spec allows several float types."""
    return {k: (w_type if isinstance(v, tuple) else v) for k, v in spec.signature.items()}


def _compile_one(job):
    """(variant, target, w_type, shape) -> dict of the code to inspect, or the compile error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_noise

    variant, target, w_type, shape = job
    backend, arch, warp_size = TARGETS[target]
    spec = triton_noise.kernel_specs(backend)[variant]
    names = spec.kernel.arg_names
    types = _arg_types(spec, w_type)
    signature = {k: types.get(k, "constexpr") for k in names}
    # The runtime's "D" specialisation (triton/backends/compiler.py: tt.divisibility 16 for a pointer
    # aligned to 16 bytes and an int that is a multiple of 16), for a call on a weight of `shape`.
    ints = call_ints(variant, shape)
    divisible = [k for k, t in types.items() if t.startswith("*") or (t == "i32" and ints[k] % 16 == 0)]
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    out = {"variant": variant, "target": target, "w_type": w_type, "shape": list(shape), "elements": spec.elements,
           "threads": spec.options["num_warps"] * warp_size}
    try:
        kernel = triton.compile(ASTSource(spec.kernel, signature, call_constexprs(spec, variant, w_type, shape), attrs),
                                target=GPUTarget(backend, arch, warp_size), options=spec.options)
    except Exception as e:  # noqa: BLE001 - reported by the test of this job
        return {**out, "error": f"{type(e).__name__}: {e}"[-4000:]}
    out["reductions"] = reductions(kernel.asm["ttgir"])
    if backend == "hip":
        return {**out, "amdgcn": kernel.asm["amdgcn"]}
    resources = None  # what ptxas allocated: registers, stack and local memory (where spills go)
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    if cuobjdump and os.path.exists(cuobjdump):
        name = f"{variant}-{target}-{w_type[1:]}-{shape[0]}x{shape[1]}.cubin"
        cubin = os.path.join(os.environ["PQT_COMPILE_DIR"], name)
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        resources = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True,
                                   check=True).stdout
    return {**out, "ptx": kernel.asm["ptx"], "resources": resources}


# Shapes on which the multi-layer block sums must lay out their sums as the per-layer kernel does: the
# model's (on every target), and on sm_90 others whose sizes are multiples of 16 in other ways.
LAYOUT_SHAPES = [(768, 2048), (33, 80)]
# Kernels new with the one pass, compiled in fewer cases to keep the time of these tests: those for shapes
# no model has (8 does not divide n) on one target of each vendor, BF16 and FP16 w for gaussws only.
ONE_PASS = ("eq3", "eq4_many")


def jobs():
    """Every variant for every target with FP32 w (the master weights); the BF16 and FP16 w that
    the launchers also accept, for sm_90; the per-layer and multi-layer block sums on LAYOUT_SHAPES."""
    from kernels import triton_noise

    out = []
    for target, (backend, _, _) in TARGETS.items():
        for variant, spec in triton_noise.kernel_specs(backend).items():
            one_pass = variant.startswith(ONE_PASS)
            if one_pass and "unaligned" in variant and target not in ("sm_90", "gfx942"):
                continue
            w_types = (tuple(W_BYTES) if spec.per_call else
                       next((v for v in spec.signature.values() if isinstance(v, tuple)), ("*fp32",)))
            for w_type in w_types:
                if w_type == "*fp32" or target == "sm_90" and not (one_pass and variant.endswith(("diffq", "aligned"))):
                    out.append((variant, target, w_type, MODEL_SHAPE))
            if variant.startswith(("block_sums", "eq4_many")) and target == "sm_90":
                out += [(variant, target, "*fp32", shape) for shape in LAYOUT_SHAPES]
    return out


def main(path):
    """Compile all jobs (in parallel over the cores) and write the results to `path` as JSON."""
    from concurrent.futures import ProcessPoolExecutor

    os.environ["PQT_COMPILE_DIR"] = os.path.dirname(os.path.abspath(path))
    with ProcessPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, 8))) as pool:
        results = list(pool.map(_compile_one, jobs()))
    with open(path, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton_compile") / "compiled.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {(r["variant"], r["target"], r["w_type"], tuple(r["shape"])): r for r in json.loads(path.read_text())}


# --- reading the code -------------------------------------------------------------------------------

_PTX_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld|st)\.global\.(?:[a-z]+\.)*?(?:v(\d)\.)?[bfsu](\d+)\b", re.M)
_GCN_ACCESS = re.compile(r"^\s*(?:global|buffer)_(load|store)_"
                         r"(dwordx4|dwordx3|dwordx2|dword|short_d16|ushort|short|ubyte|sbyte|byte)\b", re.M)
_GCN_BYTES = {"dwordx4": 16, "dwordx3": 12, "dwordx2": 8, "dword": 4, "short_d16": 2, "ushort": 2, "short": 2,
              "ubyte": 1, "sbyte": 1, "byte": 1}


def global_accesses(r):
    """({bytes: count} of global loads, {bytes: count} of global stores) in the code, per thread."""
    loads, stores = Counter(), Counter()
    if "ptx" in r:
        for op, vec, bits in _PTX_ACCESS.findall(r["ptx"]):
            (loads if op == "ld" else stores)[int(vec or 1) * int(bits) // 8] += 1
    else:
        for op, width in _GCN_ACCESS.findall(r["amdgcn"]):
            (loads if op == "load" else stores)[_GCN_BYTES[width]] += 1
    return dict(loads), dict(stores)


def _stream(bytes_per_thread):
    """{access bytes: count} that moves a thread's contiguous `bytes_per_thread` of one stream in the
    fewest accesses: full 16-byte vectors, or one narrower vector when there is less than 16."""
    if bytes_per_thread >= VECTOR_BYTES:
        assert bytes_per_thread % VECTOR_BYTES == 0
        return Counter({VECTOR_BYTES: bytes_per_thread // VECTOR_BYTES})
    return Counter({bytes_per_thread: 1})


W_BYTES = {"*fp32": 4, "*bf16": 2, "*fp16": 2}


def expected_accesses(r):
    """The global accesses a thread of this kernel needs, from the bytes of its data alone.

    A thread covers e = elements / threads elements of w (32 on NVIDIA, 16 on AMD's 64-wide
    waves for the 32 x 128 tiles). Per element the data is: w or g, 4 or 2 bytes; R, 1/2 byte for
    gaussws (one int32 word per 8 elements) or 2 for diffq (BF16); w_hat out, 2 bytes (BF16). A
    thread's elements of a stream are contiguous runs of at least 16 bytes, or one run, so each
    stream needs bytes / 16 vector accesses. The block scale is one FP32 per 32 x 32 block and a
    thread's elements lie in one block: one 4-byte load. block_sums stores one FP32 per block: one
    4-byte store per thread that holds a block's total (Triton writes each from one thread).
    gen writes R only: 1/2 byte per element (gaussws) or 2 (diffq), and reads its seed (8 bytes, from
    the device's memory: the host never reads a step's seed).
    """
    e = r["elements"] // r["threads"]
    kind, method = r["variant"].split("_")[0], ("diffq" if "diffq" in r["variant"] else "gaussws")
    r_bytes = {"gaussws": e // 2, "diffq": 2 * e}[method]
    w_bytes = W_BYTES[r["w_type"]] * e
    if kind in ("eq3", "eq4"):
        return _one_pass_accesses(r, kind, method, e, w_bytes, r_bytes)
    seed = Counter({8: 1}) if "ptx" in r else Counter()  # the seed, read from memory (AMD: a scalar load)
    if kind == "gen":
        return dict(seed), dict(_stream(r_bytes))
    if kind == "apply":
        return dict(_stream(w_bytes) + _stream(r_bytes) + Counter({4: 1})), dict(_stream(2 * e))
    if kind == "block":
        return dict(_stream(w_bytes) + _stream(r_bytes)), {4: 1}
    assert kind == "bm"  # R is made in the kernel: w and the scale in, w_hat out
    return dict(_stream(w_bytes) + Counter({4: 1})), dict(_stream(2 * e))


def _one_pass_accesses(r, kind, method, e, w_bytes, r_bytes):
    """The one pass: eq3 loads w, each block's 2^(1 - b_t) (4 bytes) and the seed (8), stores w_hat, R and
    each block's max_bl (4 bytes); eq4 loads g, R, and per block max_bl, 2^(1 - b_t) and the gradient it adds to, and
    stores Eq. 4 (4 bytes). The many kernels also read their program's layer (4 bytes) and its table row,
    one 8-byte scalar load per int64 field used (LAYER_FIELDS, the seed or the step's STEP_FIELDS; diffq
    uses no n_words_row); AMD reads what all threads of a program share with scalar loads, not counted
    among its global ones."""
    many, nvidia = "many" in r["variant"], "ptx" in r
    if kind == "eq3":
        loads, stores = _stream(w_bytes) + Counter({4: 1}), _stream(2 * e) + _stream(r_bytes) + Counter({4: 1})
        loads += Counter({8: 1}) if nvidia and not many else Counter()  # the seed (the many kernels': a field)
        fields = 9 + 1  # LAYER_FIELDS and the seed
    else:
        loads, stores = _stream(w_bytes) + _stream(r_bytes) + Counter({4: 3}), Counter({4: 1})
        fields = 7 + 3  # m, n, n_words_row, nbn, tile0, r, blk of LAYER_FIELDS; STEP_FIELDS
    if many and nvidia:
        loads += Counter({8: fields - (method == "diffq"), 4: 1})
    return dict(loads), dict(stores)


# --- the tests ----------------------------------------------------------------------------------------

JOBS = jobs()


def _id(job):
    return f"{job[0]}-{job[1]}-{job[2][1:]}" + ("" if job[3] == MODEL_SHAPE else f"-{job[3][0]}x{job[3][1]}")


@pytest.mark.parametrize("job", JOBS, ids=[_id(j) for j in JOBS])
def test_kernel_compiles_without_local_memory(compiled, job):
    r = compiled[job]
    assert "error" not in r, f"{_id(job)} does not compile: {r.get('error')}"
    if "ptx" in r:
        assert ".local" not in r["ptx"], "local memory in the PTX"
        # The cubin is what runs: ptxas's register spills show only there, as stack or local memory.
        assert r["resources"] is not None, "cuobjdump (shipped with Triton) not found"
        usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", r["resources"]))
        assert usage.get("LOCAL") == "0" and usage.get("STACK") == "0", f"ptxas resource usage {usage}"
    else:
        scratch = [int(x) for x in re.findall(r"ScratchSize:\s*(\d+)", r["amdgcn"])]
        spills = [int(x) for x in re.findall(r"[sv]gpr_spill_count:\s*(\d+)", r["amdgcn"])]
        assert scratch and not any(scratch), f"scratch memory {scratch}"
        assert spills and not any(spills), f"spilled registers {spills}"


EFFICIENCY_JOBS = [j for j in JOBS if "unaligned" not in j[0] and j[3] == MODEL_SHAPE]


@pytest.mark.parametrize("job", EFFICIENCY_JOBS, ids=[_id(j) for j in EFFICIENCY_JOBS])
def test_global_accesses_are_the_fewest_the_data_needs(compiled, job):
    r = compiled[job]
    assert "error" not in r, r.get("error")
    loads, stores = global_accesses(r)
    want_loads, want_stores = expected_accesses(r)
    assert (loads, stores) == (want_loads, want_stores), \
        f"per thread: loads {loads}, stores {stores} (bytes: count); the data needs {want_loads}, {want_stores}"


LAYOUT_JOBS = [(v, t, w, s) for v, t, w, s in JOBS if v.startswith("eq4_many") and w == "*fp32"]


@pytest.mark.parametrize("job", LAYOUT_JOBS, ids=[_id(j) for j in LAYOUT_JOBS])
def test_multi_layer_block_sums_add_in_the_per_layer_kernels_order(compiled, job):
    """Eq. 4's block sums of the many kernel are _block_sums_kernel's to the bit only if each block's 1024
    products are added in the same order: the same layout of the reduction's operand (which elements a
    thread adds first, how threads and warps then combine them). The many kernel's sizes come from a table,
    so it states as hints (tl.multiple_of) what the launcher's call of the per-layer kernel specialises;
    without them the layout, and so the order, differs."""
    variant, target, w_type, shape = job
    per_layer = compiled[(variant.replace("eq4_many", "block_sums"), target, w_type, shape)]
    assert compiled[job]["reductions"] == per_layer["reductions"] and len(per_layer["reductions"]) == 2


def test_unaligned_variants_are_the_ones_with_scalar_r():
    """The word-per-element R loads live only where a word can straddle two rows (8 does not divide n)."""
    from kernels import triton_noise

    assert triton_noise._variant("apply", "gaussws", 4096) == "apply_gaussws"
    assert triton_noise._variant("apply", "gaussws", 4100) == "apply_gaussws_unaligned"
    assert triton_noise._variant("block_sums", "diffq", 4100) == "block_sums_diffq"


def test_launch_refuses_what_the_specs_do_not_state():
    """The launchers go through _launch, so a type or argument the specs do not state cannot reach a
    kernel uncompiled by the tests above."""
    import torch

    from kernels import triton_noise

    args = dict(w_ptr=torch.zeros(32, 128), r_ptr=torch.zeros(512, dtype=torch.int32),
                scale_ptr=torch.ones(1, 4), out_ptr=torch.zeros(32, 128, dtype=torch.int16), m=32, n=128,
                n_words_row=16, nbn=4)
    with pytest.raises(TypeError, match="w_ptr is None"):
        triton_noise._launch("apply_gaussws", (1, 1), **{**args, "w_ptr": args["w_ptr"].double()})
    with pytest.raises(TypeError, match="r_ptr is \\*bf16"):
        triton_noise._launch("apply_gaussws", (1, 1), **{**args, "r_ptr": torch.zeros(4096, dtype=torch.bfloat16)})
    with pytest.raises(TypeError, match="arguments"):
        triton_noise._launch("apply_gaussws", (1, 1), **{k: v for k, v in args.items() if k != "nbn"})


def test_access_counting_reads_ptx_and_amdgcn():
    """The parser behind the efficiency test, on hand-written lines of both languages."""
    ptx = {"ptx": "\t@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n"
                  "\tld.global.nc.b32 %r5, [%rd2];\n\t@!%p2 st.global.v2.b16 [%rd3], {%rs1, %rs2};\n"
                  "\tst.shared.v4.b32 [%r9], {%r1, %r2, %r3, %r4};\n"}
    assert global_accesses(ptx) == ({16: 1, 4: 1}, {4: 1})
    gcn = {"amdgcn": "\tglobal_load_dwordx4 v[0:3], v[4:5], off\n\tglobal_load_dword v6, v[4:5], off\n"
                     "\tglobal_store_short v[4:5], v7, off\n\tbuffer_load_dwordx2 v[8:9], v10, s[0:3], 0 offen\n"}
    assert global_accesses(gcn) == ({16: 1, 4: 1, 8: 1}, {2: 1})


def test_expected_accesses_of_the_apply_tile():
    """The bound, worked by hand for gaussws apply on NVIDIA: 32 elements per thread need 128 bytes
    of FP32 w (8 x 16), 16 bytes of R (4 words: 1 x 16), one scale, and store 64 bytes (4 x 16)."""
    r = {"variant": "apply_gaussws", "w_type": "*fp32", "elements": 32 * 128, "threads": 128}
    assert expected_accesses(r) == ({16: 9, 4: 1}, {16: 4})
    r_amd = {**r, "threads": 256}  # 16 elements: 64 bytes of w, 8 of R, 32 out
    assert expected_accesses(r_amd) == ({16: 4, 8: 1, 4: 1}, {16: 2})


if __name__ == "__main__":
    main(sys.argv[1])
