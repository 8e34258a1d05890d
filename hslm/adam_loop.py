"""AdamW's elementwise update and three in-order sums, in one LLVM IR loop (a Numba
intrinsic), for hslm/optim.py.

The update vectorises; the sums around it (sum |w| and sum |m| + v of what it writes,
and the next tensors' sum of squares for their norms, each in element order) cannot,
since reordering them would change their bits. As separate passes the core ran the
serial additions after the vector work, not beside it (AdamW alone took 10.0 ms a
step on the 2-core Xeon of docs/performance-history.md, 6.0 ms in this loop). Here
each iteration updates `lanes` elements as one vector and then adds them, element by
element in order, to the three running sums, so the out-of-order core overlaps the
additions' latency with the next elements' loads, divisions and square roots. The three
sums are the lanes of one vector [sum 0, sum 1, sum 2, 0.0], and an element's three
terms are gathered into [term 0, term 1, term 2, 0.0] (shuffles), so one vector addition
an element carries all three chains: each lane is its own IEEE addition, in the same
order, so the bits are those of three scalar chains. The loop is bound by the divider
(two divisions and a square root an element) and by how many iterations the core holds
in flight while they wait on it; with three scalar additions and their lane extracts
an element it held fewer (on an AMD Zen 4, steps taken in turns: built for AVX2, 4 lanes,
the step's optimiser 6.49 to 6.06 ms; as built, 8 lanes, 5.74 to 5.07; the same bytes:
docs/performance-history.md, 2026-12-04).

Every operation is the IEEE one the scalar code does, in the same order: fmul, fadd,
fsub, fdiv and llvm.sqrt (correctly rounded), llvm.fabs, never contracted into an FMA.
A second copy of the loop body with one lane takes the elements left over. The vector
loop prefetches each stream 4 KB ahead (PREFETCH_AHEAD): it changes no value, only when
the memory comes.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .vector_tiles import declare, llvm_intrinsic, splat

# the order of the scalars in the parameter array (float64)
CLIP, DECAY, STEP_SIZE, SQRT_BC2, B1, ONE_MINUS_B1, B2, ONE_MINUS_B2, EPS = range(9)
N_PARAMS = 9


# Software prefetch, elements ahead of the loop on each of its five streams (g, m, v, w and
# the gradient ahead): 4 KB. The hardware's own prefetch left the loop waiting on memory:
# with it, the optimiser (requantising as it goes) took 6.3-6.6 ms a step against 7.1-7.5
# here (256 and 384 ahead about as fast, 1024 and 2048 slower), the same bits.
PREFETCH_AHEAD = 512


def prefetch(builder, address, for_write: bool):
    """llvm.prefetch of the cache line at address (a double*), into every cache level."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = declare(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8p, i32, i32, i32])
    builder.call(fn, [builder.bitcast(address, i8p), ir.Constant(i32, int(for_write)),
                      ir.Constant(i32, 3), ir.Constant(i32, 1)])


def make_adam_loop(lanes: int):
    """An intrinsic adam(g, m, v, w, n, params, sums, h), all intp addresses of float64
    but n.

    For i = 0 .. n-1 in order, with the scalars params[CLIP ...]:
        g = g[i] clip;  m[i] = b1 m[i] + (1 - b1) g;  v[i] = b2 v[i] + (1 - b2) (g g)
        w[i] = w[i] decay - step (m[i] / (sqrt(v[i]) / sqrt_bc2 + eps))
        sums[0] = sums[0] + |w[i]|;  sums[1] = sums[1] + (|m[i]| + v[i])
        sums[2] = sums[2] + h[i] h[i]
    (sums[0..2] hold the running sums on entry and on return). h is the gradient of a
    tensor ahead, whose norm the optimiser needs before it can update that tensor: its
    sum of squares is a third serial chain, hidden in this one's vector work."""

    def codegen(context, builder, signature, args):
        ga, ma, va, wa, n, pa, sa, ha = args
        f64, i32, i64 = ir.DoubleType(), ir.IntType(32), ir.IntType(64)
        fn = builder.function
        ptr = [builder.inttoptr(a, f64.as_pointer()) for a in (ga, ma, va, wa, ha)]
        params = builder.inttoptr(pa, f64.as_pointer())
        sums_ptr = builder.inttoptr(sa, f64.as_pointer())
        scalar = [builder.load(builder.gep(params, [ir.Constant(i64, k)]))
                  for k in range(N_PARAMS)]
        sum_ptrs = [builder.gep(sums_ptr, [ir.Constant(i64, k)]) for k in range(3)]
        s4 = ir.VectorType(f64, 4)
        sums0 = ir.Constant(s4, [0.0] * 4)  # [sum 0, sum 1, sum 2, 0.0]: a lane a sum
        for k, p in enumerate(sum_ptrs):
            sums0 = builder.insert_element(sums0, builder.load(p), ir.Constant(i32, k))
        n_vec = builder.mul(builder.sdiv(n, ir.Constant(i64, lanes)), ir.Constant(i64, lanes))
        ahead = ir.Constant(i64, PREFETCH_AHEAD)

        def element_terms(terms, width):
            """[terms[0][e], terms[1][e], terms[2][e], 0.0] for each element e of the
            vectors: the three sums' terms of one element, a lane each."""
            if width == 1:
                out = ir.Constant(s4, [0.0] * 4)
                for k, x in enumerate(terms):
                    out = builder.insert_element(out, x, ir.Constant(i32, k))
                return [out]
            vt = terms[0].type

            def interleave(x, y):  # [x0, y0, x1, y1, ...]
                mask = [j for e in range(width) for j in (e, width + e)]
                return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(i32, 2 * width),
                                                                mask))
            ab = interleave(terms[0], terms[1])
            c0 = interleave(terms[2], ir.Constant(vt, [0.0] * width))
            return [builder.shuffle_vector(ab, c0, ir.Constant(ir.VectorType(i32, 4), [
                2 * e, 2 * e + 1, 2 * width + 2 * e, 2 * width + 2 * e + 1]))
                for e in range(width)]

        def loop(width, start, stop, sums_in):
            """Elements start .. stop-1, `width` at a time; returns the sums at the exit."""
            vt = ir.VectorType(f64, width) if width > 1 else f64
            pre = builder.block
            body = fn.append_basic_block(f"adam.body{width}")
            done = fn.append_basic_block(f"adam.done{width}")
            builder.cbranch(builder.icmp_signed("<", start, stop), body, done)
            builder.position_at_end(body)
            i = builder.phi(i64)
            sums = builder.phi(s4)
            c = [splat(builder, x, vt) for x in scalar]
            addr = [builder.bitcast(builder.gep(p, [i]), vt.as_pointer()) for p in ptr]
            if width > 1:  # each stream PREFETCH_AHEAD elements ahead (m, v, w to be written)
                for k, p in enumerate(ptr):
                    prefetch(builder, builder.gep(p, [builder.add(i, ahead)]), k in (1, 2, 3))
            g, m, v, w, h = [builder.load(a, align=8) for a in addr]
            g = builder.fmul(g, c[CLIP])
            m = builder.fadd(builder.fmul(c[B1], m), builder.fmul(c[ONE_MINUS_B1], g))
            v = builder.fadd(builder.fmul(c[B2], v),
                             builder.fmul(c[ONE_MINUS_B2], builder.fmul(g, g)))
            den = builder.fadd(builder.fdiv(builder.call(llvm_intrinsic(builder, "sqrt", vt, 1), [v]),
                                            c[SQRT_BC2]), c[EPS])
            w = builder.fsub(builder.fmul(w, c[DECAY]),
                             builder.fmul(c[STEP_SIZE], builder.fdiv(m, den)))
            for a, x in zip(addr[1:4], (m, v, w)):
                builder.store(x, a, align=8)
            fabs = llvm_intrinsic(builder, "fabs", vt, 1)
            aw = builder.call(fabs, [w])
            terms = (aw, builder.fadd(builder.call(fabs, [m]), v), builder.fmul(h, h))
            nxt = sums
            for e in element_terms(terms, width):  # the sums, one element at a time, in order
                nxt = builder.fadd(nxt, e)
            i_next = builder.add(i, ir.Constant(i64, width))
            for phi, first, last in ((i, start, i_next), (sums, sums_in, nxt)):
                phi.add_incoming(first, pre)
                phi.add_incoming(last, body)
            builder.cbranch(builder.icmp_signed("<", i_next, stop), body, done)
            builder.position_at_end(done)
            out = builder.phi(s4)
            out.add_incoming(sums_in, pre)
            out.add_incoming(nxt, body)
            return out

        sums1 = loop(lanes, ir.Constant(i64, 0), n_vec, sums0)
        sums2 = loop(1, n_vec, n, sums1)
        for k, p in enumerate(sum_ptrs):
            builder.store(builder.extract_element(sums2, ir.Constant(i32, k)), p)
        return context.get_dummy_value()

    def adam(typingctx, g, m, v, w, n, params, sums, h):
        return types.void(*[types.intp] * 8), codegen

    adam.__name__ = f"adam_loop_{lanes}"
    return intrinsic(adam)
