#!/usr/bin/env python3
"""hostcuda's compiler: a CUDA kernel source of tern to a host shared object (see kernel.h).

    translate.py SOURCE.cu OUT.so

Three steps. The source is preprocessed alone (g++ -E: it includes no headers), so that every
macro-made kernel, shared array and asm statement is spelled out. Then the few constructs that
are not C++ are rewritten into calls of kernel.h: each `asm` statement becomes the call of the
PTX instruction it issues (an instruction not in the table below is an error that names it),
each `__shared__` declaration a reference into the block's shared arena, and the `__global__`
kernels are listed in a table the driver launches from. Last, g++ compiles the result with
kernel.h in front, without contraction of multiply-adds (-ffp-contract=off). Errors go to
stderr with a nonzero exit; the fake NVRTC returns them as the compile log.
"""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CXX = os.environ.get("TERN_HOSTCUDA_CXX") or os.environ.get("CXX") or "g++"


def fail(msg):
    sys.stderr.write(f"hostcuda: {msg}\n")
    sys.exit(1)


def literal_end(text, i):
    """Index of the quote closing the string or char literal that opens at i."""
    j = i + 1
    while text[j] != text[i]:
        j += 2 if text[j] == "\\" else 1
    return j


def matching(text, open_at, open_ch="(", close_ch=")"):
    """Index of the bracket closing the one at open_at, skipping string and char literals."""
    depth, i = 0, open_at
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = literal_end(text, i)
        elif c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    fail(f"unbalanced {open_ch}{close_ch} at offset {open_at}")


def split_top(text, sep):
    """Splits at sep outside brackets and string literals."""
    parts, depth, cur, i = [], 0, [], 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            j = literal_end(text, i)
            cur.append(text[i : j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


# The PTX tern writes inline: the instruction (after a `{ .reg ...;` prologue) by prefix, the
# call of kernel.h that performs it (outputs by address in operand order, then inputs), and the
# number of operands it takes. griddepcontrol sits under __CUDA_ARCH__ and never gets here.
PTX = [
    ("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "tern_host_ptx::ldmatrix_x4(true, {args})", 5),
    ("ldmatrix.sync.aligned.m8n8.x4.shared.b16", "tern_host_ptx::ldmatrix_x4(false, {args})", 5),
    ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "tern_host_ptx::mma_m16n8k16_bf16({args})", 10),
    ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "tern_host_ptx::mma_m16n8k8_tf32({args})", 10),
    ("cvt.rna.tf32.f32", "tern_host_ptx::cvt_rna_tf32_f32({args})", 2),
    ("cvt.rn.bf16x2.f32", "tern_host_ptx::cvt_rn_bf16x2_f32({args})", 3),
    ("cvt.rn.bf16.f32", "tern_host_ptx::cvt_rn_bf16_f32({args})", 2),
    ("cvt.f32.f16", "tern_host_ptx::cvt_f32_f16({args})", 2),
    ("cvta.to.shared.u64", "tern_host_ptx::cvta_to_shared_u32({args})", 2),
    ("cp.async.cg.shared.global", None, None),  # by operand count, below
    ("cp.async.commit_group", "tern_host_ptx::cp_async_commit_group()", 0),
    ("cp.async.wait_group", "tern_host_ptx::cp_async_wait_group({args})", 1),
    ("cp.async.wait_all", "tern_host_ptx::cp_async_wait_all()", 0),
    ("prefetch.global.L2", "tern_host_ptx::prefetch({args})", 1),
    ("bar.sync", "tern_host_ptx::bar_sync({args})", 2),
    ("griddepcontrol.", "tern_host_ptx::griddepcontrol()", 0),
    ("wgmma.fence.sync.aligned", "tern_host_ptx::wgmma_fence()", 0),
    ("wgmma.commit_group.sync.aligned", "tern_host_ptx::wgmma_commit_group()", 0),
    ("wgmma.wait_group.sync.aligned", "tern_host_ptx::wgmma_wait_group({args})", 1),
    ("fence.proxy.async.shared::cta", "tern_host_ptx::fence_proxy_async()", 0),
    ("wgmma.mma_async.", None, None),  # by its shape, below
]

# The forms of warpgroup product modelled (kernel.h): bf16 operands from two descriptors, B
# K-major (trans-b 0), A K-major or M-major (trans-a 0 or 1), scales 1, scale-d the predicate p
# that the prologue sets from an operand.
WGMMA = re.compile(
    r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16\s*\{[^}]*\}\s*,\s*%(\d+)\s*,\s*%(\d+)\s*,"
    r"\s*p\s*,\s*1\s*,\s*1\s*,\s*([01])\s*,\s*0\s*;"
)
# The register form: A's four registers, then B's descriptor (trans-b 0).
WGMMA_RS = re.compile(
    r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16\s*\{[^}]*\}\s*,"
    r"\s*\{\s*%(\d+)\s*,\s*%(\d+)\s*,\s*%(\d+)\s*,\s*%(\d+)\s*\}\s*,\s*%(\d+)\s*,"
    r"\s*p\s*,\s*1\s*,\s*1\s*,\s*0\s*;"
)
SCALE_D = re.compile(r"setp\.ne\.b32\s+p\s*,\s*%(\d+)\s*,\s*0\s*;")


def wgmma_call(template, instr, outs, ins):
    """The call of kernel.h for one warpgroup product, after checking its form."""
    m, rs, scale = WGMMA.match(instr), WGMMA_RS.match(instr), SCALE_D.search(template)
    if rs and scale:
        n = int(rs.group(1))
        first = n // 2
        if len(outs) != n // 2 or len(ins) != 6 or [int(x) for x in rs.groups()[1:]] + [int(scale.group(1))] != list(range(first, first + 6)):
            fail(f"{template!r}: wgmma operands not as the model takes them ({n // 2} accumulators, A's four registers, B's descriptor, scale-d)")
        acc = ", ".join(f"&({e})" for c, e in outs)
        return f"tern_host_ptx::wgmma_m64k16_bf16_rs<{n}>({{{acc}}}, " + ", ".join(f"({e})" for c, e in ins) + ")"
    if not m or not scale:
        fail(f"wgmma form not modelled (bf16, A and K-major B from descriptors, scale-d from setp.ne.b32 p): {template!r}")
    n, da, db = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if len(outs) != n // 2 or len(ins) != 3 or (da, db, int(scale.group(1))) != (n // 2, n // 2 + 1, n // 2 + 2):
        fail(f"{template!r}: wgmma operands not as the model takes them ({n // 2} accumulators, then the two descriptors and scale-d)")
    acc = ", ".join(f"&({e})" for c, e in outs)
    trans_a = int(m.group(4))
    return f"tern_host_ptx::wgmma_m64k16_bf16<{n}, {trans_a}>({{{acc}}}, " + ", ".join(f"({e})" for c, e in ins) + ")"


def operands(section):
    """[(constraint, expression)] of one operand section of an asm statement."""
    out = []
    for part in split_top(section, ","):
        part = part.strip()
        if not part:
            continue
        m = re.match(r'"([^"]*)"\s*\((.*)\)\s*$', part, re.S)
        if not m:
            fail(f"cannot read asm operand {part!r}")
        out.append((m.group(1), m.group(2).strip()))
    return out


def rewrite_asm(text):
    out, pos = [], 0
    for m in re.finditer(r"\basm\b(\s+volatile\b)?\s*\(", text):
        if m.start() < pos:
            continue
        open_at = m.end() - 1
        close = matching(text, open_at)
        body = text[open_at + 1 : close]
        lit = re.match(r'\s*((?:"(?:[^"\\]|\\.)*"\s*)+)', body, re.S)
        if not lit:
            fail(f"asm without a template: {body[:80]!r}")
        template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', lit.group(1)))
        sections = split_top(body[lit.end() :], ":")[1:]
        outs = operands(sections[0]) if len(sections) > 0 else []
        ins = operands(sections[1]) if len(sections) > 1 else []
        instr = re.sub(r"^\s*\{\s*(\.reg[^;]*;\s*)*(setp\.ne\.b32\s+p\s*,\s*%\d+\s*,\s*0\s*;\s*)?", "", template).strip()
        for prefix, call, count in PTX:
            if instr.startswith(prefix):
                break
        else:
            fail(f"PTX instruction not modelled: {template!r}")
        if prefix == "wgmma.mma_async.":
            out.append(text[pos : m.start()])
            out.append(wgmma_call(template, instr, outs, ins))
            pos = close + 1
            continue
        if prefix == "cp.async.cg.shared.global":
            call = "tern_host_ptx::cp_async_16({args})" if len(ins) == 2 else "tern_host_ptx::cp_async_16_n({args})"
            count = len(ins)
        args = [f"&({e})" for c, e in outs] + [f"({e})" for c, e in ins]
        if len(args) != count:
            fail(f"{template!r}: {len(args)} operands, the model takes {count}")
        out.append(text[pos : m.start()])
        out.append(call.format(args=", ".join(args)))
        pos = close + 1
    out.append(text[pos:])
    return "".join(out)


def rewrite_shared(text):
    """__shared__ declarations -> references into the block's shared arena (kernel.h)."""
    counter = [0]

    def declare(m):
        is_extern, decl = m.group(1), m.group(2)
        decl = re.sub(r"__align__\s*\(\s*\d+\s*\)", "", decl).strip()
        # The type is every token before the first declarator: a name followed by [ , or the end.
        first = re.search(r"\b([A-Za-z_]\w*)\s*(?=\[|,|$)", decl)
        if not first:
            fail(f"cannot read shared declaration {decl!r}")
        ctype = decl[: first.start()].strip()
        if not ctype:
            fail(f"shared declaration without a type: {decl!r}")
        stmts = []
        for d in split_top(decl[first.start() :], ","):
            dm = re.match(r"\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\])*)\s*$", d)
            if not dm:
                fail(f"cannot read shared declarator {d!r}")
            name, dims = dm.group(1), dm.group(2)
            if is_extern:
                if dims.replace(" ", "") != "[]":
                    fail(f"extern __shared__ {name} is not an unsized array")
                stmts.append(f"{ctype}* {name} = static_cast<{ctype}*>(tern_host::dynamic_shared());")
                continue
            counter[0] += 1
            key = f"tern_host_shared_key_{counter[0]}"
            if dims:
                stmts.append(
                    f"static char {key}; {ctype} (&{name}){dims} = "
                    f"*static_cast<{ctype} (*){dims}>(tern_host::static_shared(&{key}, sizeof({ctype}{dims})));"
                )
            else:
                stmts.append(
                    f"static char {key}; {ctype}& {name} = *static_cast<{ctype}*>(tern_host::static_shared(&{key}, sizeof({ctype})));"
                )
        return " ".join(stmts)

    return re.sub(r"(\bextern\s+)?\b__shared__\b([^;]*);", declare, text)


def strip_launch_bounds(text):
    out, pos = [], 0
    for m in re.finditer(r"\b__launch_bounds__\s*\(", text):
        if m.start() < pos:
            continue
        close = matching(text, m.end() - 1)
        out.append(text[pos : m.start()])
        pos = close + 1
    out.append(text[pos:])
    return "".join(out)


def main():
    if len(sys.argv) != 3:
        fail("usage: translate.py SOURCE.cu OUT.so")
    src, out = sys.argv[1], sys.argv[2]
    pre = subprocess.run([CXX, "-E", "-P", "-x", "c++", "-std=c++17", src], capture_output=True, text=True)
    if pre.returncode != 0:
        sys.stderr.write(pre.stderr)
        fail("preprocessing failed")
    text = strip_launch_bounds(pre.stdout)
    text = rewrite_asm(text)
    text = rewrite_shared(text)
    kernels = []
    for m in re.finditer(r"\b__global__\s+void\s+([A-Za-z_]\w*)\s*\(", text):
        if m.group(1) not in kernels:
            kernels.append(m.group(1))
    if not kernels:
        fail("no __global__ kernel in the source")
    text = re.sub(r"\b__global__\b", "", text)
    table = ",\n".join(
        f'    {{"{k}", [](void** p) {{ tern_host::call(&{k}, p); }}, '
        f"decltype(tern_host::param_sizes(&{k}))::n, decltype(tern_host::param_sizes(&{k}))::sizes}}"
        for k in kernels
    )
    unit = (
        f'#include "{os.path.join(HERE, "kernel.h")}"\n'
        + text
        + f'\nextern "C" const tern_host::Kernel tern_host_kernels[] = {{\n{table}\n}};\n'
        + f'extern "C" const int tern_host_kernel_count = {len(kernels)};\n'
    )
    cpp = out + ".cpp"
    with open(cpp, "w") as f:
        f.write(unit)
    # TERN_HOSTCUDA_CFLAGS replaces the optimisation flags (e.g. "-O0 -g" to debug a kernel).
    flags = os.environ.get("TERN_HOSTCUDA_CFLAGS", "-O1 -g0").split()
    cc = subprocess.run(
        [CXX, "-std=c++17", *flags, "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing",
         "-fvisibility=hidden", "-w", "-o", out, cpp],
        capture_output=True,
        text=True,
    )
    if cc.returncode != 0:
        sys.stderr.write(cc.stderr[-20000:])
        fail(f"compiling the translated source failed (kept at {cpp})")
    if not os.environ.get("TERN_HOSTCUDA_KEEP"):
        os.remove(cpp)


if __name__ == "__main__":
    main()
