"""AdamW's elementwise update and three in-order sums, in one LLVM IR loop (a Numba
intrinsic), for hslm/optim.py.

The update vectorises; the sums around it (sum |w| and sum |m| + v of what it writes,
and the next tensors' sum of squares for their norms, each in element order) cannot,
since reordering them would change their bits. As separate passes the core ran the
serial additions after the vector work, not beside it (AdamW alone took 10.0 ms a
step on the 2-core Xeon of docs/performance-history.md, 6.0 ms in this loop). Here
each iteration updates `lanes` elements as one vector and then adds them, element by
element in order, to the three running sums, so the out-of-order core overlaps the
additions' latency with the next elements' loads, divisions and square roots. How an
element's three terms reach the sums (each sum one chain, in element order, so the bits
are those of three scalar chains whatever the vectors) depends on the width:

* 8 lanes (AVX-512 on AMD): the sums are the lanes of one vector [sum 0, sum 1, sum 2,
  0.0] and each element's terms are gathered into one (shuffles across the vector): one
  vector addition an element (VectorSums);
* 4 lanes: sum |w| is a scalar chain (its terms wait on the divider) and the other two
  a pair [sum 1, sum 2] (their terms are ready early), fed by unpacks within 128-bit
  halves and extracts of halves (PairedSums): no shuffle that crosses 128 bits, which
  cores with 128-bit pipes (the first-generation Zen) pay for several times over.

The loop's tail, one element at a time, keeps its main loop's way.

The loop is bound by the divider (two divisions and a square root an element) and by
how many iterations the core holds in flight while they wait on it; the three scalar
chains with their twelve lane extracts for four elements held fewer. On an AMD Zen 4,
steps taken in turns against those (docs/performance-history.md, 2026-12-04): as
built, 8 lanes, the optimiser 5.74 to 5.07 ms (and 0.95x PairedSums' time there);
built for AVX2, 4 lanes, 6.49 to 6.06 ms with VectorSums, the same or better with
PairedSums (llvm-mca: 70 cycles for four elements on the first-generation Zen, as the
scalar chains, against 118 with VectorSums); the same bytes.

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

from .vector_tiles import llvm_intrinsic, prefetch_line, splat

# the order of the scalars in the parameter array (float64)
CLIP, DECAY, STEP_SIZE, SQRT_BC2, B1, ONE_MINUS_B1, B2, ONE_MINUS_B2, EPS = range(9)
N_PARAMS = 9


# Software prefetch, elements ahead of the loop on each of its five streams (g, m, v, w and
# the gradient ahead): 4 KB. The hardware's own prefetch left the loop waiting on memory:
# with it, the optimiser (requantising as it goes) took 6.3-6.6 ms a step against 7.1-7.5
# here (256 and 384 ahead about as fast, 1024 and 2048 slower), the same bits.
PREFETCH_AHEAD = 512


class VectorSums:
    """The three sums as the lanes of one vector [s0, s1, s2, 0.0]; an element's terms
    gathered into [t0, t1, t2, 0.0] and added: one vector addition an element."""

    def __init__(self, builder):
        self.b = builder
        self.vt = ir.VectorType(ir.DoubleType(), 4)

    def types(self):
        return [self.vt]

    def load(self, ptrs):
        out = ir.Constant(self.vt, [0.0] * 4)
        for k, p in enumerate(ptrs):
            out = self.b.insert_element(out, self.b.load(p), ir.Constant(ir.IntType(32), k))
        return [out]

    def store(self, sums, ptrs):
        for k, p in enumerate(ptrs):
            self.b.store(self.b.extract_element(sums[0], ir.Constant(ir.IntType(32), k)), p)

    def add(self, sums, terms, width):
        b, i32 = self.b, ir.IntType(32)
        if width == 1:
            gathered = ir.Constant(self.vt, [0.0] * 4)
            for k, x in enumerate(terms):
                gathered = b.insert_element(gathered, x, ir.Constant(i32, k))
            each = [gathered]
        else:
            zero = ir.Constant(terms[0].type, [0.0] * width)

            def interleave(x, y):  # [x0, y0, x1, y1, ...]
                return b.shuffle_vector(x, y, ir.Constant(ir.VectorType(i32, 2 * width), [
                    j for e in range(width) for j in (e, width + e)]))
            ab, c0 = interleave(terms[0], terms[1]), interleave(terms[2], zero)
            each = [b.shuffle_vector(ab, c0, ir.Constant(ir.VectorType(i32, 4), [
                2 * e, 2 * e + 1, 2 * width + 2 * e, 2 * width + 2 * e + 1]))
                for e in range(width)]
        total = sums[0]
        for e in each:  # one element at a time, in order
            total = b.fadd(total, e)
        return [total]


class PairedSums:
    """sum |w| as a scalar chain and the other two sums as a pair [s1, s2]; an element's
    pair of terms taken from unpacks within 128-bit halves, no shuffle across them."""

    def __init__(self, builder):
        self.b = builder
        self.pt = ir.VectorType(ir.DoubleType(), 2)

    def types(self):
        return [ir.DoubleType(), self.pt]

    def load(self, ptrs):
        pair = ir.Constant(self.pt, [0.0] * 2)
        for k in (1, 2):
            pair = self.b.insert_element(pair, self.b.load(ptrs[k]),
                                         ir.Constant(ir.IntType(32), k - 1))
        return [self.b.load(ptrs[0]), pair]

    def store(self, sums, ptrs):
        self.b.store(sums[0], ptrs[0])
        for k in (1, 2):
            self.b.store(self.b.extract_element(sums[1], ir.Constant(ir.IntType(32), k - 1)),
                         ptrs[k])

    def add(self, sums, terms, width):
        b, i32 = self.b, ir.IntType(32)
        w_sum, pair = sums
        if width == 1:
            pairs = [b.insert_element(b.insert_element(ir.Constant(self.pt, [0.0] * 2),
                                                       terms[1], ir.Constant(i32, 0)),
                                      terms[2], ir.Constant(i32, 1))]
            lanes = [terms[0]]
        else:
            half = width // 2
            lo, hi = (b.shuffle_vector(terms[1], terms[2], ir.Constant(
                ir.VectorType(i32, width),
                [j for k in range(half) for j in (2 * k + o, width + 2 * k + o)]))
                for o in (0, 1))  # [x0 y0 x2 y2 ...], [x1 y1 x3 y3 ...]
            pairs = [b.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, 2),
                                                        [2 * k, 2 * k + 1]))
                     for k in range(half) for v in (lo, hi)]  # elements 0, 1, 2, ...
            lanes = [b.extract_element(terms[0], ir.Constant(i32, e)) for e in range(width)]
        for x in lanes:  # one element at a time, in order
            w_sum = b.fadd(w_sum, x)
        for x in pairs:
            pair = b.fadd(pair, x)
        return [w_sum, pair]


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
        f64, i64 = ir.DoubleType(), ir.IntType(64)
        fn = builder.function
        ptr = [builder.inttoptr(a, f64.as_pointer()) for a in (ga, ma, va, wa, ha)]
        params = builder.inttoptr(pa, f64.as_pointer())
        sums_ptr = builder.inttoptr(sa, f64.as_pointer())
        scalar = [builder.load(builder.gep(params, [ir.Constant(i64, k)]))
                  for k in range(N_PARAMS)]
        sum_ptrs = [builder.gep(sums_ptr, [ir.Constant(i64, k)]) for k in range(3)]
        sums_of = (VectorSums if lanes >= 8 else PairedSums)(builder)
        sums0 = sums_of.load(sum_ptrs)
        n_vec = builder.mul(builder.sdiv(n, ir.Constant(i64, lanes)), ir.Constant(i64, lanes))
        ahead = ir.Constant(i64, PREFETCH_AHEAD)

        def loop(width, start, stop, sums_in):
            """Elements start .. stop-1, `width` at a time; returns the sums at the exit."""
            vt = ir.VectorType(f64, width) if width > 1 else f64
            pre = builder.block
            body = fn.append_basic_block(f"adam.body{width}")
            done = fn.append_basic_block(f"adam.done{width}")
            builder.cbranch(builder.icmp_signed("<", start, stop), body, done)
            builder.position_at_end(body)
            i = builder.phi(i64)
            sums = [builder.phi(t) for t in sums_of.types()]
            c = [splat(builder, x, vt) for x in scalar]
            addr = [builder.bitcast(builder.gep(p, [i]), vt.as_pointer()) for p in ptr]
            if width > 1:  # each stream PREFETCH_AHEAD elements ahead (m, v, w to be written)
                for k, p in enumerate(ptr):
                    prefetch_line(builder, builder.gep(p, [builder.add(i, ahead)]),
                                  int(k in (1, 2, 3)))
            g, m, v, w, h = [builder.load(a, align=8) for a in addr]
            g = builder.fmul(g, c[CLIP])
            m = builder.fadd(builder.fmul(c[B1], m), builder.fmul(c[ONE_MINUS_B1], g))
            v = builder.fadd(builder.fmul(c[B2], v),
                             builder.fmul(c[ONE_MINUS_B2], builder.fmul(g, g)))
            sqrt = llvm_intrinsic(builder, "sqrt", vt, 1)
            den = builder.fadd(builder.fdiv(builder.call(sqrt, [v]), c[SQRT_BC2]), c[EPS])
            w = builder.fsub(builder.fmul(w, c[DECAY]),
                             builder.fmul(c[STEP_SIZE], builder.fdiv(m, den)))
            for a, x in zip(addr[1:4], (m, v, w)):
                builder.store(x, a, align=8)
            fabs = llvm_intrinsic(builder, "fabs", vt, 1)
            terms = (builder.call(fabs, [w]), builder.fadd(builder.call(fabs, [m]), v),
                     builder.fmul(h, h))
            nxt = sums_of.add(sums, terms, width)
            i_next = builder.add(i, ir.Constant(i64, width))
            for phi, first, last in zip([i] + sums, [start] + sums_in, [i_next] + nxt):
                phi.add_incoming(first, pre)
                phi.add_incoming(last, body)
            builder.cbranch(builder.icmp_signed("<", i_next, stop), body, done)
            builder.position_at_end(done)
            out = [builder.phi(t) for t in sums_of.types()]
            for phi, first, last in zip(out, sums_in, nxt):
                phi.add_incoming(first, pre)
                phi.add_incoming(last, body)
            return out

        sums1 = loop(lanes, ir.Constant(i64, 0), n_vec, sums0)
        sums_of.store(loop(1, n_vec, n, sums1), sum_ptrs)
        return context.get_dummy_value()

    def adam(typingctx, g, m, v, w, n, params, sums, h):
        return types.void(*[types.intp] * 8), codegen

    adam.__name__ = f"adam_loop_{lanes}"
    return intrinsic(adam)
