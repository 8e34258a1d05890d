"""A register tile's inner loop written in LLVM IR with explicit vectors (a Numba
intrinsic), for the kernels of hslm/panel_kernels.py (ternary matrices and the weight
gradient) and attention's rows (hslm/layers.py).

Numba has no vector types, so the generated kernels held a tile in named scalars and
relied on LLVM's SLP vectoriser to pack them. For the ternary 9 x 16 tile it packed
most of them but not all: its loop did 20 FMAs, 4 conversions and 3 lane inserts for
the 18 FMAs and 2 conversions the tile needs (per input index), and the kernel ran at
about 55% of this core's measured FMA peak. Here the loop is written as the tile
means it: per input index, `vecs` panel vectors loaded, each of `rows` inputs
broadcast, and rows x vecs vector multiply-adds. The ternary kernels widen a chunk of
a panel's int8 trits to float64 once (make_widen) for all the row tiles that use it:
converting in the tile's loop cost 6 of the 24 operations per input index that the
9 x 16 tile gave the two FMA ports.

The sums are the plain loops' sums: each output element starts at 0.0 and adds
x[r, i] * t[i, c] for i = 0, 1, ... in order. The multiply-add is llvm.fmuladd,
which fuses where the core has FMA: the product x * t is exact for t in {-1, 0, +1},
so one rounding or two give the same bits, on any core. (Only for ternary panels:
other products are not exact, and fusing them would change bits. The float64 tile,
for attention's scores and outputs and the weight gradient, multiplies and then adds,
as the plain loops do.)

Two byte helpers serve requantisation's int8 panels (hslm.params.quantize_into): a
16-byte copy and a 16 x 16 byte transpose in registers.

The active-position tile (make_active_rows_tile) runs a weight gradient's rows, each
row's sums in registers over the set bits of its mask: the MLP's products beside its
ReLU, whose zeros it skips with the same bits (hslm.kernels.active_rows_grad).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def declare(builder, name: str, ret, args):
    """The module's declaration of the function `name` (an LLVM intrinsic or a C
    function) returning ret and taking args (LLVM types), made on first use."""
    return builder.module.globals.get(name) or ir.Function(
        builder.module, ir.FunctionType(ret, list(args)), name=name)


def prefetch_line(builder, address, rw: int = 0, locality: int = 3):
    """llvm.prefetch of the cache line at address (any pointer): to be written (rw 1) or
    read (rw 0), into every cache level (locality 3) or only as near as L2 (1). A hint:
    no value changes."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = declare(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8p, i32, i32, i32])
    builder.call(fn, [builder.bitcast(address, i8p), ir.Constant(i32, rw),
                      ir.Constant(i32, locality), ir.Constant(i32, 1)])


def llvm_intrinsic(builder, name: str, vt, nargs: int):
    """The module's declaration of llvm.<name> for vt (a vector of doubles, or a double)
    taking nargs of them, made on first use."""
    suffix = f"v{vt.count}f64" if isinstance(vt, ir.VectorType) else "f64"
    return declare(builder, f"llvm.{name}.{suffix}", vt, [vt] * nargs)


class CountedLoop:
    """for i in range(0, n, step) in IR, skipped when n <= 0: `with CountedLoop(builder,
    n, step, name) as loop:` leaves the builder in the loop's body, loop.i the counter;
    after the block the builder is past the loop. loop.entry (the block before the loop)
    and loop.latch (the body's last block) are the incoming blocks of phis."""

    def __init__(self, builder, n, step: int, name: str):
        self.builder, self.n, self.step = builder, n, step
        self.entry = builder.block
        self.head = builder.function.append_basic_block(f"{name}.loop")
        self.done = builder.function.append_basic_block(f"{name}.done")

    def __enter__(self):
        b, i64 = self.builder, ir.IntType(64)
        b.cbranch(b.icmp_signed(">", self.n, ir.Constant(i64, 0)), self.head, self.done)
        b.position_at_end(self.head)
        self.i = b.phi(i64)
        return self

    def __exit__(self, kind, value, trace):
        if kind is None:
            b, i64 = self.builder, ir.IntType(64)
            self.latch = b.block
            i_next = b.add(self.i, ir.Constant(i64, self.step))
            self.i.add_incoming(ir.Constant(i64, 0), self.entry)
            self.i.add_incoming(i_next, self.latch)
            b.cbranch(b.icmp_signed("<", i_next, self.n), self.head, self.done)
            b.position_at_end(self.done)
        return False


def splat(builder, x, vt):
    """The value x in every lane of vt (x itself when vt is a scalar type)."""
    if not isinstance(vt, ir.VectorType):
        return x
    i32 = ir.IntType(32)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(i32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined),
                                  ir.Constant(ir.VectorType(i32, vt.count), [0] * vt.count))


def make_tile(rows: int, vecs: int, lanes: int, ternary: bool = True, add_into: bool = False,
              p_stride: int = 0, resume: bool = False, pair: bool = False,
              single: bool = False):
    """An intrinsic tile(x_addr, x_stride, p_addr, a, out_addr), all intp:

    X: float64 rows at x_addr, x_stride elements apart; P: `a` rows of vecs * lanes
    float64 at p_addr, contiguous (ternary: trits -1, 0, +1, widened from a panel's
    int8 by make_widen). For
    i = 0 .. a-1 in order: acc[r, c] = acc[r, c] + X[r, i] P[i, c], from 0.0 (fused
    for trits, else the product rounded and then added); then
    out[r * width + c] = acc[r, c] (float64 at out_addr; width vecs * lanes, or p_stride).

    add_into (the weight gradient, G += X . D): the intrinsic takes two more arguments,
    tile(x_addr, x_stride, p_addr, a, out_addr, out_stride, fresh), and adds the sums
    into out's rows, out_stride elements apart: out[r, c] = base + acc[r, c], base
    out[r, c] or, where fresh is nonzero, 0.0 (the bits of zeroed memory added to).
    p_stride: elements from one row of P to the next when the tile is narrower than
    its panels (vecs * lanes by default), and (but with add_into) from one row of out to
    the next: a narrow tile's sums lie where a full one's would.

    resume (a sum over i in chunks): the intrinsic takes one more argument, tile(x_addr,
    x_stride, p_addr, a, out_addr, more), and where more is nonzero the sums start from
    out's values (an earlier chunk's sums, stored by the tile) instead of 0.0, and go on
    adding: the same chain of additions as one loop over every i.

    pair (with add_into; the weight gradient of two windows): tile(x_addr, x_stride,
    x_off, p_addr, p_off, a, out_addr, out_stride, fresh). A second X and P lie x_off and
    p_off elements after the first; both tiles are summed in the same loop, each from 0.0
    in its own registers, and out[r, c] = (base + acc[r, c]) + acc2[r, c]: the bits of the
    two windows' tiles added into out one after the other, with half the stores, loads of
    out and loop exits.

    single (ternary only): P holds float32 (make_widen(panel, single=True)), each vector
    converted to float64 as it is loaded (-1, 0, +1 exactly): vcvtps2pd, which on AMD's
    cores runs on a pipe beside the FMA's."""
    width = p_stride or vecs * lanes
    sets = 2 if pair else 1
    if single and not ternary:
        raise ValueError("make_tile: only ternary panels may be float32")

    def codegen(context, builder, signature, args):
        if pair:
            xa, xs, x_off, pa, p_off, n, oa = args[:7]
            args = (xa, xs, pa, n, oa) + tuple(args[7:])
        else:
            xa, xs, pa, n, oa = args[:5]
        f64, i64 = ir.DoubleType(), ir.IntType(64)
        vt = ir.VectorType(f64, lanes)
        zero = ir.Constant(vt, [0.0] * lanes)
        pt = ir.FloatType() if single else f64  # what P holds
        xptrs = [builder.inttoptr(xa, f64.as_pointer())]
        pptrs = [builder.inttoptr(pa, pt.as_pointer())]
        if pair:
            xptrs.append(builder.gep(xptrs[0], [x_off]))
            pptrs.append(builder.gep(pptrs[0], [p_off]))
        optr = builder.inttoptr(oa, f64.as_pointer())
        fmuladd = llvm_intrinsic(builder, "fmuladd", vt, 3)
        if resume:  # go on from the earlier chunk's sums, or start from 0.0
            more = builder.icmp_signed("!=", args[5], ir.Constant(i64, 0))
            start = [[builder.select(more, builder.load(builder.bitcast(
                builder.gep(optr, [ir.Constant(i64, r * width + v * lanes)]), vt.as_pointer()),
                align=8), zero) for v in range(vecs)] for r in range(rows)]
        else:
            start = [[zero] * vecs for _ in range(rows)]
        entry = builder.block
        loop = builder.function.append_basic_block("tile.loop")
        sums = builder.function.append_basic_block("tile.sums")
        zeros = builder.function.append_basic_block("tile.zeros")
        done = builder.function.append_basic_block("tile.done")
        builder.cbranch(builder.icmp_signed(">", n, ir.Constant(i64, 0)), loop, zeros)

        def store_all(values):  # out[r * width + v * lanes ...] = values[0][r][v]
            for r in range(rows):
                for v in range(vecs):
                    if add_into:  # out[r * out_stride + v * lanes ...] = base + values[r][v]
                        at = builder.add(builder.mul(ir.Constant(i64, r), args[5]),
                                         ir.Constant(i64, v * lanes))
                    else:
                        at = ir.Constant(i64, r * width + v * lanes)
                    p = builder.bitcast(builder.gep(optr, [at]), vt.as_pointer())
                    value = values[0][r][v]
                    if add_into:
                        fresh = builder.icmp_signed("!=", args[6], ir.Constant(i64, 0))
                        value = builder.select(fresh, zero, builder.load(p, align=8))
                        for k in range(sets):  # (base + acc) + acc2: window order
                            value = builder.fadd(value, values[k][r][v])
                    builder.store(value, p, align=8)
            builder.branch(done)

        builder.position_at_end(loop)  # one input index i per iteration
        i = builder.phi(i64)
        acc = [[[builder.phi(vt) for _ in range(vecs)] for _ in range(rows)] for _ in range(sets)]
        row_i = builder.mul(i, ir.Constant(i64, width))
        new = []
        for k in range(sets):
            t = []
            for v in range(vecs):
                p = builder.gep(pptrs[k], [builder.add(row_i, ir.Constant(i64, v * lanes))])
                if single:
                    st = ir.VectorType(pt, lanes)
                    t.append(builder.fpext(builder.load(builder.bitcast(p, st.as_pointer()),
                                                        align=4), vt))
                else:
                    t.append(builder.load(builder.bitcast(p, vt.as_pointer()), align=8))
            new.append([])
            for r in range(rows):
                x = builder.load(builder.gep(xptrs[k], [builder.add(
                    builder.mul(ir.Constant(i64, r), xs), i)]), align=8)
                xv = splat(builder, x, vt)
                new[k].append([builder.call(fmuladd, [xv, t[v], acc[k][r][v]]) if ternary else
                               builder.fadd(acc[k][r][v], builder.fmul(xv, t[v]))
                               for v in range(vecs)])
        i_next = builder.add(i, ir.Constant(i64, 1))
        i.add_incoming(ir.Constant(i64, 0), entry)
        i.add_incoming(i_next, loop)
        for k in range(sets):
            for r in range(rows):
                for v in range(vecs):
                    acc[k][r][v].add_incoming(start[r][v], entry)
                    acc[k][r][v].add_incoming(new[k][r][v], loop)
        builder.cbranch(builder.icmp_signed("<", i_next, n), loop, sums)
        builder.position_at_end(sums)  # the sums out to memory
        store_all(new)
        builder.position_at_end(zeros)  # a = 0: every sum is 0.0 (or as it was)
        store_all([start] * sets)
        builder.position_at_end(done)
        return context.get_dummy_value()

    if pair:
        def tile(typingctx, x_addr, x_stride, x_off, p_addr, p_off, a, out_addr, out_stride,
                 fresh):
            return types.void(*[types.intp] * 9), codegen
    elif add_into:
        def tile(typingctx, x_addr, x_stride, p_addr, a, out_addr, out_stride, fresh):
            return types.void(*[types.intp] * 7), codegen
    elif resume:
        def tile(typingctx, x_addr, x_stride, p_addr, a, out_addr, more):
            return types.void(*[types.intp] * 6), codegen
    else:
        def tile(typingctx, x_addr, x_stride, p_addr, a, out_addr):
            return types.void(*[types.intp] * 5), codegen

    tile.__name__ = (f"{'ternary' if ternary else 'float64'}_tile_{rows}x{vecs * lanes}"
                     + ("_resume" if resume else "")
                     + ("_add_into" if add_into else "") + (f"_of_{width}" if p_stride else "")
                     + ("_pair" if pair else "") + ("_f32" if single else ""))
    return intrinsic(tile)


# vcvtqq2pd, int64 lanes to float64 (rounding 4: as MXCSR says; exact for trits anyway).
# Compiled and checked (golden digests, the instruction in the code) with numba 0.61
# (LLVM 15) and 0.68 (LLVM 22).
QQ2PD = "llvm.x86.avx512.sitofp.round.v8f64.v8i64"


def make_widen(panel: int, single: bool = False):
    """An intrinsic widen(p_addr, a, dst_addr), all intp: `a` rows of `panel` int8 trits
    at p_addr (a ternary panel, contiguous) into float64 (float32 where single) at
    dst_addr, row by row. A ternary kernel widens each panel once for all its row tiles,
    whose loops (make_tile) then load its vectors as they are (where single, converting
    them to float64 as they load them: half the bytes stored here)."""

    def codegen(context, builder, signature, args):
        pa, n, da = args
        features = getattr(context.codegen(), "_tm_features", "") or ""
        by_quadwords = not single and panel % 8 == 0 and "+avx512dq" in features.split(",")
        i64, f64 = ir.IntType(64), ir.FloatType() if single else ir.DoubleType()
        st, dt = ir.VectorType(ir.IntType(8), panel), ir.VectorType(f64, panel)
        src = builder.inttoptr(pa, ir.IntType(8).as_pointer())
        dst = builder.inttoptr(da, f64.as_pointer())
        with CountedLoop(builder, n, 1, "widen") as loop:
            at = builder.mul(loop.i, ir.Constant(i64, panel))
            if by_quadwords:  # each 8 trits sign-extended to int64, then vcvtqq2pd
                q8, v8, d8 = (ir.VectorType(t, 8) for t in (ir.IntType(8), i64, f64))
                convert = declare(builder, QQ2PD, d8, [v8, ir.IntType(32)])
                for h in range(0, panel, 8):
                    at_h = builder.add(at, ir.Constant(i64, h))
                    trits = builder.load(builder.bitcast(builder.gep(src, [at_h]),
                                                         q8.as_pointer()), align=1)
                    wide = builder.call(convert, [builder.sext(trits, v8),
                                                  ir.Constant(ir.IntType(32), 4)])
                    builder.store(wide, builder.bitcast(builder.gep(dst, [at_h]),
                                                        d8.as_pointer()), align=8)
            else:
                trits = builder.load(builder.bitcast(builder.gep(src, [at]), st.as_pointer()),
                                     align=1)
                builder.store(builder.sitofp(trits, dt),
                              builder.bitcast(builder.gep(dst, [at]), dt.as_pointer()),
                              align=4 if single else 8)
        return context.get_dummy_value()

    def widen(typingctx, p_addr, a, dst_addr):
        return types.void(types.intp, types.intp, types.intp), codegen

    widen.__name__ = f"widen_trits_{panel}" + ("_f32" if single else "")
    return intrinsic(widen)


def _prefetch_intrinsic(name: str, rw: int, locality: int):
    """An intrinsic name(addr, nbytes), both intp, of _prefetch_lines(rw, locality)."""

    def prefetch(typingctx, addr, nbytes):
        return types.void(types.intp, types.intp), _prefetch_lines(rw, locality)

    prefetch.__name__ = name
    return intrinsic(prefetch)


def _prefetch_lines(rw: int, locality: int):
    """The codegen of prefetch(addr, nbytes): llvm.prefetch of every cache line of bytes
    addr .. addr + nbytes - 1, to be written (rw 1) or read (rw 0), into every cache level
    (locality 3: prefetcht0 or prefetchw) or only as near as L2 (1: prefetcht2)."""

    def codegen(context, builder, signature, args):
        addr, nbytes = args
        i8, i64 = ir.IntType(8), ir.IntType(64)
        first = builder.and_(addr, ir.Constant(i64, -64))  # the first byte's line
        span = builder.sub(builder.add(addr, nbytes), first)
        base = builder.inttoptr(first, i8.as_pointer())
        with CountedLoop(builder, span, 64, "prefetch") as loop:
            prefetch_line(builder, builder.gep(base, [loop.i]), rw, locality)
        return context.get_dummy_value()

    return codegen


def make_prefetch_for_writing():
    """An intrinsic prefetch_for_writing(addr, nbytes), both intp: asks for the cache lines
    of bytes addr .. addr + nbytes - 1 to be brought in, to be written (llvm.prefetch:
    a hint, never a fault, no effect on any value). A ternary kernel asks for the
    next panel's columns of its output while it sums this one: each output line is
    written whole, but a line not in cache is read before it is written, and a window's
    outputs were last used a step ago. prefetchw where the core has it, else prefetcht0
    (AVX2 as Haswell); checked in the code with numba 0.61 (LLVM 15) and 0.68."""

    return _prefetch_intrinsic("prefetch_for_writing", 1, 3)


def make_prefetch_to_l2():
    """An intrinsic prefetch_to_l2(addr, nbytes), both intp: every cache line of the
    bytes, to be read, into L2 only (prefetcht2), for a layer's records a few products
    ahead: brought into L1 they had pushed out the lines of the products in between."""

    return _prefetch_intrinsic("prefetch_to_l2", 0, 1)


def make_cycle_counter():
    """An intrinsic cycles() -> int64: the core's cycle counter (llvm.readcyclecounter:
    the time-stamp counter on x86, which runs at a constant rate; 0 where a machine has
    none). hslm bench's profile reads it around each matrix product inside the step, as
    no clock is callable from Numba's compiled code; it never touches a value."""

    def codegen(context, builder, signature, args):
        counter = declare(builder, "llvm.readcyclecounter", ir.IntType(64), [])
        return builder.call(counter, [])

    def cycles(typingctx):
        return types.int64(), codegen

    return intrinsic(cycles)


def make_transpose_bytes(width: int):
    """An intrinsic transpose(src_addr, src_stride, dst_addr), all intp: for c < width,
    j < 16, dst[j * width + c] = src[c * src_stride + j]. A 16 x 16 block of bytes is
    transposed in registers (4 rounds of byte interleaves, 64 shuffles for 256 bytes,
    instead of 256 single-byte loads and stores) and each of its 16 columns stored as a
    run of `width` <= 16 bytes (its first `width` rows): so 16 rows are read from src,
    the ones from `width` on only to be dropped."""

    def codegen(context, builder, signature, args):
        src, stride, dst = args
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        vt = ir.VectorType(i8, 16)
        sp = builder.inttoptr(src, i8.as_pointer())
        dp = builder.inttoptr(dst, i8.as_pointer())
        rows = [builder.load(builder.bitcast(
            builder.gep(sp, [builder.mul(ir.Constant(i64, c), stride)]), vt.as_pointer()), align=1)
            for c in range(16)]
        mask_lo, mask_hi = (ir.Constant(ir.VectorType(i32, 16),
                                        [half + k // 2 + 16 * (k % 2) for k in range(16)])
                            for half in (0, 8))  # [a0 b0 a1 b1 ...], [a8 b8 a9 b9 ...]
        for _ in range(4):  # out[2i], out[2i + 1] = interleave(rows[i], rows[i + 8]): a perfect
            nxt = []          # shuffle of the 256 bytes; four of them transpose the block
            for i in range(8):
                nxt.append(builder.shuffle_vector(rows[i], rows[i + 8], mask_lo))
                nxt.append(builder.shuffle_vector(rows[i], rows[i + 8], mask_hi))
            rows = nxt
        ot = ir.VectorType(i8, width)
        first = ir.Constant(ir.VectorType(i32, width), list(range(width)))
        for j in range(16):
            p = builder.bitcast(builder.gep(dp, [ir.Constant(i64, width * j)]), ot.as_pointer())
            col = rows[j] if width == 16 else builder.shuffle_vector(
                rows[j], ir.Constant(vt, ir.Undefined), first)
            builder.store(col, p, align=1)
        return context.get_dummy_value()

    def transpose(typingctx, src_addr, src_stride, dst_addr):
        return types.void(types.intp, types.intp, types.intp), codegen

    transpose.__name__ = f"transpose_bytes_16_to_{width}"
    return intrinsic(transpose)


def make_copy_bytes(width: int):
    """An intrinsic copy(src_addr, dst_addr): dst[0:width] = src[0:width] as one vector (in
    requantisation, the 16-byte loop it replaced had cost 0.7 ms of 2.1)."""

    def codegen(context, builder, signature, args):
        vp = ir.VectorType(ir.IntType(8), width).as_pointer()
        src, dst = (builder.inttoptr(a, vp) for a in args)
        builder.store(builder.load(src, align=1), dst, align=1)
        return context.get_dummy_value()

    def copy(typingctx, src_addr, dst_addr):
        return types.void(types.intp, types.intp), codegen

    copy.__name__ = f"copy_bytes_{width}"
    return intrinsic(copy)


def make_trits(lanes: int):
    """An intrinsic trits(src_addr, n, half, dst_addr) -> the count of zero trits made:
    for i below n rounded down to a multiple of `lanes` (the caller does the rest),
    dst[i] = 1 if src[i] > half, -1 if src[i] < -half, else 0 (a NaN gives 0), as int8
    from float64, `lanes` at a time. Built for AVX2, Numba's own loop packed the
    compares to bytes one element at a time (0.094 ms for a 243 x 729 tensor against
    0.021 built for AVX-512); written as vectors, 0.049, and 0.022 for AVX-512. A trit
    is the byte (src > half) | -(src < -half) (half > 0, so at most one holds: the two
    compares' masks go to bytes once, where a select had packed each and blended them),
    and the zeros are counted by popcount of the byte compare's mask (built for AVX2,
    34.8 us for 243 x 729: docs/performance-history.md, 2026-12-04)."""

    def codegen(context, builder, signature, args):
        src, n, half, dst = args
        i8, i64, f64 = ir.IntType(8), ir.IntType(64), ir.DoubleType()
        vt, bt, mt = ir.VectorType(f64, lanes), ir.VectorType(i8, lanes), ir.IntType(lanes)
        sp = builder.inttoptr(src, f64.as_pointer())
        dp = builder.inttoptr(dst, i8.as_pointer())
        hi = splat(builder, half, vt)
        lo = splat(builder, builder.fneg(half), vt)
        ctpop = declare(builder, f"llvm.ctpop.i{lanes}", mt, [mt])
        count = builder.mul(builder.sdiv(n, ir.Constant(i64, lanes)), ir.Constant(i64, lanes))
        with CountedLoop(builder, count, lanes, "trits") as loop:
            zeros = builder.phi(i64)
            v = builder.load(builder.bitcast(builder.gep(sp, [loop.i]), vt.as_pointer()), align=8)
            t = builder.or_(builder.zext(builder.fcmp_ordered(">", v, hi), bt),
                            builder.sext(builder.fcmp_ordered("<", v, lo), bt))
            builder.store(t, builder.bitcast(builder.gep(dp, [loop.i]), bt.as_pointer()), align=1)
            is_zero = builder.bitcast(builder.icmp_signed("==", t, ir.Constant(bt, [0] * lanes)),
                                      mt)
            zeros_next = builder.add(zeros, builder.zext(builder.call(ctpop, [is_zero]), i64))
        zeros.add_incoming(ir.Constant(i64, 0), loop.entry)
        zeros.add_incoming(zeros_next, loop.latch)
        total = builder.phi(i64)
        total.add_incoming(ir.Constant(i64, 0), loop.entry)
        total.add_incoming(zeros_next, loop.latch)
        return total

    def trits(typingctx, src_addr, n, half, dst_addr):
        return types.intp(types.intp, types.intp, types.float64, types.intp), codegen

    trits.__name__ = f"trits_{lanes}"
    return intrinsic(trits)


def make_active_rows_tile(vecs: int, lanes: int, exact: bool = True):
    """An intrinsic tile(m_addr, m_stride, words, x_addr, x_stride, d_addr, d_stride, last,
    out_addr, out_stride, rows, prefetch_below, positions, fresh), all intp: `rows`
    consecutive rows r of a weight gradient, each over the positions where its sparse
    factor is active (the ReLU's units: half of them are 0.0 at any position).

    Row r: the set bits t of the int64 words at m_addr + 8 r, m_stride words apart (bit b
    of word w is position 64 w + b), in increasing order, add x[t x_stride + r]
    D[t d_stride + c] into acc[c] from 0.0, the product rounded and then added, as the
    dense tile does; then out[r out_stride + c] = base + acc[c], base what it held, or
    where fresh is nonzero acc[c] (0.0 + acc[c] has its bits). The columns are `vecs`
    vectors at 0, lanes, 2 lanes, ..., the last at `last` (the last full vector of the
    row, at least (vecs - 2) lanes: it may overlap the one before it, so its base is
    loaded before that one is stored; overlapping lanes get the same bits twice).
    exact=False: a row of fewer vectors, down
    to one, each vector clamped to `last` (those past it repeat it, every base loaded
    before any is stored); its runtime offsets take a register each, and the loop is
    slower. At each row r < prefetch_below with r % 8 == 0, the next 8 rows' x lines are
    asked for (positions of them: x's column r + 8 at every position).

    The rows loop here, not in Numba: per row the mask, x and out addresses step in
    registers, and a sum is stored straight from its register (built for 16 registers,
    loading all 13 bases before the first store had spilled 9 of them to the stack).

    Skipping a position where x is 0.0 changes no bit: x D is then +-0.0 (D finite),
    and a sum that starts from +0.0 is never -0.0, so adding +-0.0 leaves it as it
    was. (A step with a non-finite D has a non-finite loss or norm and is stopped.)"""

    def codegen(context, builder, signature, args):
        ma, ms, words, xa, xs, da, ds, last, oa, os_, rows, pf_below, positions, fresh = args
        f64, i64 = ir.DoubleType(), ir.IntType(64)
        vt = ir.VectorType(f64, lanes)
        zero = ir.Constant(vt, [0.0] * lanes)
        one, c8, c64 = ir.Constant(i64, 1), ir.Constant(i64, 8), ir.Constant(i64, 64)
        dptr = builder.inttoptr(da, f64.as_pointer())
        cttz = declare(builder, "llvm.cttz.i64", i64, [i64, ir.IntType(1)])
        offsets = []
        for v in range(vecs):
            at = ir.Constant(i64, v * lanes)
            if v == vecs - 1:
                offsets.append(last)
            elif exact:  # constant offsets: one pointer a row, not one a vector (16 GPRs)
                offsets.append(at)
            else:
                offsets.append(builder.select(builder.icmp_signed("<", at, last), at, last))
        is_fresh = builder.icmp_signed("!=", fresh, ir.Constant(i64, 0))
        entry = builder.block
        blocks = {name: builder.function.append_basic_block(f"active.{name}")
                  for name in ("row", "ask", "start", "word", "bits", "latch", "sums", "add",
                               "fresh", "next", "done")}
        builder.cbranch(builder.icmp_signed(">", rows, ir.Constant(i64, 0)), blocks["row"],
                        blocks["done"])

        builder.position_at_end(blocks["row"])  # row r: its mask words, x's column, out's row
        r = builder.phi(i64)
        mptr = builder.inttoptr(builder.add(ma, builder.mul(r, c8)), i64.as_pointer())
        x_r = builder.add(xa, builder.mul(r, c8))
        xptr = builder.inttoptr(x_r, f64.as_pointer())
        optr = builder.inttoptr(builder.add(oa, builder.mul(r, builder.mul(os_, c8))),
                                f64.as_pointer())
        due = builder.and_(builder.icmp_signed("<", r, pf_below),
                           builder.icmp_signed("==", builder.and_(r, ir.Constant(i64, 7)),
                                               ir.Constant(i64, 0)))
        builder.cbranch(due, blocks["ask"], blocks["start"])

        builder.position_at_end(blocks["ask"])  # (a hint: no value changes)
        ahead = builder.inttoptr(builder.add(x_r, c64), f64.as_pointer())
        with CountedLoop(builder, positions, 1, "active.ask") as loop:
            prefetch_line(builder, builder.gep(ahead, [builder.mul(loop.i, xs)]))
        builder.branch(blocks["start"])

        builder.position_at_end(blocks["start"])
        builder.cbranch(builder.icmp_signed(">", words, ir.Constant(i64, 0)), blocks["word"],
                        blocks["sums"])

        builder.position_at_end(blocks["word"])  # one int64 word of the mask (64 positions)
        w = builder.phi(i64)
        acc_w = [builder.phi(vt) for _ in range(vecs)]
        mask = builder.load(builder.gep(mptr, [builder.mul(w, ms)]), align=8)
        t0 = builder.mul(w, c64)
        builder.cbranch(builder.icmp_signed("!=", mask, ir.Constant(i64, 0)), blocks["bits"],
                        blocks["latch"])

        builder.position_at_end(blocks["bits"])  # one set bit, the lowest first: position t
        m = builder.phi(i64)
        acc = [builder.phi(vt) for _ in range(vecs)]
        t = builder.add(t0, builder.call(cttz, [m, ir.Constant(ir.IntType(1), 1)]))
        m_next = builder.and_(m, builder.sub(m, one))
        xv = splat(builder, builder.load(builder.gep(xptr, [builder.mul(t, xs)]), align=8), vt)
        d_row = builder.mul(t, ds)
        new = []
        for v in range(vecs):
            p = builder.bitcast(builder.gep(dptr, [builder.add(d_row, offsets[v])]),
                                vt.as_pointer())
            new.append(builder.fadd(acc[v], builder.fmul(xv, builder.load(p, align=8))))
        m.add_incoming(mask, blocks["word"])
        m.add_incoming(m_next, blocks["bits"])
        for v in range(vecs):
            acc[v].add_incoming(acc_w[v], blocks["word"])
            acc[v].add_incoming(new[v], blocks["bits"])
        builder.cbranch(builder.icmp_signed("!=", m_next, ir.Constant(i64, 0)), blocks["bits"],
                        blocks["latch"])

        builder.position_at_end(blocks["latch"])
        acc_l = [builder.phi(vt) for _ in range(vecs)]
        for v in range(vecs):
            acc_l[v].add_incoming(acc_w[v], blocks["word"])
            acc_l[v].add_incoming(new[v], blocks["bits"])
        w_next = builder.add(w, one)
        w.add_incoming(ir.Constant(i64, 0), blocks["start"])
        w.add_incoming(w_next, blocks["latch"])
        for v in range(vecs):
            acc_w[v].add_incoming(zero, blocks["start"])
            acc_w[v].add_incoming(acc_l[v], blocks["latch"])
        builder.cbranch(builder.icmp_signed("<", w_next, words), blocks["word"], blocks["sums"])

        builder.position_at_end(blocks["sums"])
        total = [builder.phi(vt) for _ in range(vecs)]
        for v in range(vecs):
            total[v].add_incoming(zero, blocks["start"])
            total[v].add_incoming(acc_l[v], blocks["latch"])
        ptrs = [builder.bitcast(builder.gep(optr, [offsets[v]]), vt.as_pointer())
                for v in range(vecs)]
        builder.cbranch(is_fresh, blocks["fresh"], blocks["add"])

        # fresh: the sum itself, the bits of 0.0 + sum (a sum from +0.0 is never -0.0).
        # (Stored as 0.0 + sum, LLVM sank both ways' additions into one with a phi of
        # 0.0 or the base for each vector: 26 vectors live for 16 registers, the bases
        # copied through the stack on every row, and 0.0 written to the stack for the
        # fresh way.)
        builder.position_at_end(blocks["fresh"])
        for p, value in zip(ptrs, total):
            builder.store(value, p, align=8)
        builder.branch(blocks["next"])

        builder.position_at_end(blocks["add"])
        if exact:  # only the last vector overlaps another (the one before it)
            base_last = builder.load(ptrs[-1], align=8)
            for p, value in zip(ptrs[:-1], total[:-1]):
                builder.store(builder.fadd(builder.load(p, align=8), value), p, align=8)
            builder.store(builder.fadd(base_last, total[-1]), ptrs[-1], align=8)
        else:  # clamped vectors may repeat: every base loaded before any is stored
            values = [builder.fadd(builder.load(p, align=8), s) for p, s in zip(ptrs, total)]
            for p, value in zip(ptrs, values):
                builder.store(value, p, align=8)
        builder.branch(blocks["next"])

        builder.position_at_end(blocks["next"])
        r_next = builder.add(r, one)
        r.add_incoming(ir.Constant(i64, 0), entry)
        r.add_incoming(r_next, blocks["next"])
        builder.cbranch(builder.icmp_signed("<", r_next, rows), blocks["row"], blocks["done"])

        builder.position_at_end(blocks["done"])
        return context.get_dummy_value()

    def tile(typingctx, m_addr, m_stride, words, x_addr, x_stride, d_addr, d_stride, last,
             out_addr, out_stride, rows, prefetch_below, positions, fresh):
        return types.void(*[types.intp] * 14), codegen

    tile.__name__ = f"active_rows_tile_{vecs * lanes}" + ("" if exact else "_clamped")
    return intrinsic(tile)


def make_nonzero_bits(lanes: int):
    """An intrinsic nonzero_bits(x_addr, n) -> int64, both intp: bit i set where float64
    x[i] (i < n <= 64) is not 0.0: +-0.0 clear, NaN set (`fcmp une`), so that a kernel that
    skips the clear ones skips only zeros. `lanes` elements a compare (vcmppd and a
    movemask), the last n % lanes one at a time."""

    def codegen(context, builder, signature, args):
        xa, n = args
        f64, i64 = ir.DoubleType(), ir.IntType(64)
        vt = ir.VectorType(f64, lanes)
        xptr = builder.inttoptr(xa, f64.as_pointer())
        entry = builder.block
        full = builder.sub(n, builder.srem(n, ir.Constant(i64, lanes)))
        vec_loop = builder.function.append_basic_block("nz.vec")
        vec_done = builder.function.append_basic_block("nz.vec_done")
        tail_loop = builder.function.append_basic_block("nz.tail")
        done = builder.function.append_basic_block("nz.done")
        builder.cbranch(builder.icmp_signed(">", full, ir.Constant(i64, 0)), vec_loop, vec_done)

        builder.position_at_end(vec_loop)
        i = builder.phi(i64)
        word = builder.phi(i64)
        v = builder.load(builder.bitcast(builder.gep(xptr, [i]), vt.as_pointer()), align=8)
        bits = builder.fcmp_unordered("!=", v, ir.Constant(vt, [0.0] * lanes))
        chunk = builder.zext(builder.bitcast(bits, ir.IntType(lanes)), i64)
        word_next = builder.or_(word, builder.shl(chunk, i))
        i_next = builder.add(i, ir.Constant(i64, lanes))
        i.add_incoming(ir.Constant(i64, 0), entry)
        i.add_incoming(i_next, vec_loop)
        word.add_incoming(ir.Constant(i64, 0), entry)
        word.add_incoming(word_next, vec_loop)
        builder.cbranch(builder.icmp_signed("<", i_next, full), vec_loop, vec_done)

        builder.position_at_end(vec_done)
        w0 = builder.phi(i64)
        w0.add_incoming(ir.Constant(i64, 0), entry)
        w0.add_incoming(word_next, vec_loop)
        builder.cbranch(builder.icmp_signed("<", full, n), tail_loop, done)

        builder.position_at_end(tail_loop)
        j = builder.phi(i64)
        wt = builder.phi(i64)
        x = builder.load(builder.gep(xptr, [j]), align=8)
        bit = builder.zext(builder.fcmp_unordered("!=", x, ir.Constant(f64, 0.0)), i64)
        wt_next = builder.or_(wt, builder.shl(bit, j))
        j_next = builder.add(j, ir.Constant(i64, 1))
        j.add_incoming(full, vec_done)
        j.add_incoming(j_next, tail_loop)
        wt.add_incoming(w0, vec_done)
        wt.add_incoming(wt_next, tail_loop)
        builder.cbranch(builder.icmp_signed("<", j_next, n), tail_loop, done)

        builder.position_at_end(done)
        out = builder.phi(i64)
        out.add_incoming(w0, vec_done)
        out.add_incoming(wt_next, tail_loop)
        return out

    def nonzero_bits(typingctx, x_addr, n):
        return types.int64(types.intp, types.intp), codegen

    nonzero_bits.__name__ = f"nonzero_bits_{lanes}"
    return intrinsic(nonzero_bits)


def make_sparse_rows_tile(panels: int, panel: int, lanes: int, single: bool):
    """An intrinsic tile(mask, x_addr, w_addr, out_addr, more), all intp: one row of a
    ternary product whose input row x is mostly zeros (the ReLU's output, or its
    gradient), over the set bits of `mask` only (nonzero_bits: input i of the chunk is
    bit i), each in increasing order:
        acc[c] = fma(x[i], W[i, c], acc[c])   for c < panels * panel,
    from out[c] where more is nonzero (the chunk before's sums: one chain over the whole
    input index), else from 0.0; then out[c] = acc[c]. W: `panels` widened chunks of a
    ternary matrix's panels one after another, each [64, panel] (float64, or float32 where
    single, converted as loaded: make_widen). As in make_tile, fma(x, t, y) with t in
    {-1, 0, +1} rounds as y + x t does; and a skipped input adds x t = +-0.0, which
    changes no bit of a sum from +0.0 (such a sum is never -0.0)."""
    vpp = panel // lanes  # vectors a panel
    vecs = panels * vpp

    def codegen(context, builder, signature, args):
        mask, xa, wa, oa, more = args
        f64, i64 = ir.DoubleType(), ir.IntType(64)
        pt = ir.FloatType() if single else f64
        vt, st = ir.VectorType(f64, lanes), ir.VectorType(pt, lanes)
        zero = ir.Constant(vt, [0.0] * lanes)
        xptr = builder.inttoptr(xa, f64.as_pointer())
        wptr = builder.inttoptr(wa, pt.as_pointer())
        optr = builder.inttoptr(oa, f64.as_pointer())
        fmuladd = llvm_intrinsic(builder, "fmuladd", vt, 3)
        cttz = declare(builder, "llvm.cttz.i64", i64, [i64, ir.IntType(1)])
        is_more = builder.icmp_signed("!=", more, ir.Constant(i64, 0))
        ptrs = [builder.bitcast(builder.gep(optr, [ir.Constant(i64, v * lanes)]),
                                vt.as_pointer()) for v in range(vecs)]
        start = [builder.select(is_more, builder.load(p, align=8), zero) for p in ptrs]
        entry = builder.block
        bits = builder.function.append_basic_block("sparse.bits")
        done = builder.function.append_basic_block("sparse.done")
        builder.cbranch(builder.icmp_signed("!=", mask, ir.Constant(i64, 0)), bits, done)

        builder.position_at_end(bits)  # input i, the lowest set bit left
        m = builder.phi(i64)
        acc = [builder.phi(vt) for _ in range(vecs)]
        i = builder.call(cttz, [m, ir.Constant(ir.IntType(1), 1)])
        m_next = builder.and_(m, builder.sub(m, ir.Constant(i64, 1)))
        xv = splat(builder, builder.load(builder.gep(xptr, [i]), align=8), vt)
        row = builder.mul(i, ir.Constant(i64, panel))
        new = []
        for v in range(vecs):
            at = builder.add(row, ir.Constant(i64, (v // vpp) * 64 * panel + (v % vpp) * lanes))
            p = builder.gep(wptr, [at])
            if single:
                t = builder.fpext(builder.load(builder.bitcast(p, st.as_pointer()), align=4), vt)
            else:
                t = builder.load(builder.bitcast(p, vt.as_pointer()), align=8)
            new.append(builder.call(fmuladd, [xv, t, acc[v]]))
        m.add_incoming(mask, entry)
        m.add_incoming(m_next, bits)
        for v in range(vecs):
            acc[v].add_incoming(start[v], entry)
            acc[v].add_incoming(new[v], bits)
        builder.cbranch(builder.icmp_signed("!=", m_next, ir.Constant(i64, 0)), bits, done)

        builder.position_at_end(done)
        totals = [builder.phi(vt) for _ in range(vecs)]
        for v in range(vecs):
            totals[v].add_incoming(start[v], entry)
            totals[v].add_incoming(new[v], bits)
        for v in range(vecs):
            builder.store(totals[v], ptrs[v], align=8)
        return context.get_dummy_value()

    def tile(typingctx, mask, x_addr, w_addr, out_addr, more):
        return types.void(*[types.intp] * 5), codegen

    tile.__name__ = f"sparse_rows_tile_{panels}x{panel}" + ("_f32" if single else "")
    return intrinsic(tile)


def make_popcount():
    """An intrinsic popcount(word) -> int64: the bits set in an int64 (llvm.ctpop: popcnt)."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        return builder.call(declare(builder, "llvm.ctpop.i64", i64, [i64]), [args[0]])

    def popcount(typingctx, word):
        return types.int64(types.int64), codegen

    return intrinsic(popcount)
