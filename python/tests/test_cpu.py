"""CPU tests of the installed msa_ptx wheel: no GPU and no torch needed.

Tensors are stand-ins that speak the protocol the extension reads (``dtype``, ``shape``,
``stride()``, ``device``, ``data_ptr()``); CPU int32 ones are backed by ``array.array``, so the
schedule checks read real values. Expected values come from the seed contract (constants,
the documented ``chunk_map`` examples) or are derived by hand below, never from the package.
Run by scripts/test.sh; by hand: ``PYTHONPATH=<wheel install dir> python3 -m unittest
discover -s python/tests -v``.
"""

import array
import unittest

import msa_ptx
from msa_ptx import _native


class Device:
    def __init__(self, type, index=None):
        self.type, self.index = type, index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


def contiguous_strides(shape):
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


class Fake:
    """A tensor stand-in. ``values`` (int32 on the CPU) gives it real memory."""

    def __init__(self, shape, dtype="torch.bfloat16", device=("cuda", 0), values=None,
                 ptr=0x7F0000000000, strides=None):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = Device(*device)
        self._strides = tuple(strides) if strides else contiguous_strides(self.shape)
        self._values = None
        if values is not None:
            self._values = array.array("i", values)
            assert len(self._values) == self.numel(), (shape, len(self._values))
            ptr = self._values.buffer_info()[0]
        self._ptr = ptr
        self.copies = 0

    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    def stride(self):
        return self._strides

    def data_ptr(self):
        return self._ptr

    def is_contiguous(self):
        return self._strides == contiguous_strides(self.shape)

    def detach(self):
        return self

    def _copy(self):
        c = Fake(self.shape, self.dtype, (self.device.type, self.device.index), ptr=0x7F0000010000)
        c.copies = self.copies + 1
        return c

    contiguous = clone = _copy


def cpu_i32(shape, values):
    return Fake(shape, "torch.int32", ("cpu", None), values=values)


# One document of T = 5 tokens, every query selecting its own (only) block 0, the rest -1.
# By the contract (docs/design.md §2.1): one CSR row per head holding queries 0..4, so
# row_ptr[h] = [0, 5]; one work item per head, (h, row 0, q_begin 0, q_count 5, doc 0,
# block 0); W = 128 (one 128-row block).
T = 5


def causal_q2k():
    return [0 if slot == 0 else -1 for h in range(4) for t in range(T) for slot in range(16)]


def tiny_fields(**override):
    fields = {
        "row_ptr": ([4, 2], [0, 5] * 4),
        "q_indices": ([4, 5], list(range(5)) * 4),
        "scheduler_metadata": ([4, 6], [x for h in range(4) for x in (h, 0, 0, 5, 0, 0)]),
        "work_count": ([1], [4]),
        "cu_seqlens": ([2], [0, 5]),
        "document_workspace_starts": ([1], [0]),
    }
    fields.update(override)
    return [cpu_i32(shape, values) for shape, values in fields.values()]


def backward_args(t=T, w=128, **override):
    args = {
        "q": Fake([t, 64, 128]),
        "k_aligned": Fake([w, 4, 128]),
        "v_aligned": Fake([w, 4, 128]),
        "grad_out": Fake([t, 64, 128]),
        "lse": Fake([t, 64], "torch.float32"),
        "out": Fake([t, 64, 128]),
    }
    args.update(override)
    return list(args.values())


class Contract(unittest.TestCase):
    def test_constants_are_the_seed_contract(self):
        self.assertEqual(
            (msa_ptx.BLOCK_SIZE, msa_ptx.HEAD_DIM, msa_ptx.NUM_Q_HEADS, msa_ptx.NUM_KV_HEADS,
             msa_ptx.NUM_INDEX_HEADS, msa_ptx.TOPK_BLOCKS, msa_ptx.QUERY_CHUNK),
            (128, 128, 64, 4, 4, 16, 8))
        self.assertAlmostEqual(msa_ptx.SOFTMAX_SCALE, 128 ** -0.5, places=7)

    def test_chunk_map_matches_the_documented_examples(self):
        for args, want in [((0, 4, 8), (0, 1, 0)), ((32, 4, 8), (8, 1, 8)),
                           ((49, 4, 8), (8, 3, 14)), ((1, 4, 8), (0, 4, 1)),
                           ((2401, 64, 8), (32, 45, 40)), ((2560, 64, 8), (40, 1, 40))]:
            self.assertEqual(msa_ptx.chunk_map(*args), want, args)
        self.assertEqual((msa_ptx.rows_per_cta(2400), msa_ptx.rows_per_cta(2401)), (4, 64))
        for cap in (0, 100, 2400, 10 ** 6):
            self.assertEqual(msa_ptx.grid_launch_bound(cap, 132),
                             max(min(cap, 2400) // 4, cap // 64) + 132)


class Schedule(unittest.TestCase):
    def test_a_hand_built_schedule_validates(self):
        s = msa_ptx.MSABackwardSchedule(*tiny_fields()).validate()
        self.assertEqual((s.num_tokens, s.workspace_rows, s.num_documents), (5, 128, 1))
        self.assertIs(s.poll(), True)
        self.assertFalse(s.on_device)

    def test_a_field_that_is_not_int32_is_a_type_error(self):
        f = tiny_fields()
        f[1] = Fake([4, 5], "torch.int64", ("cpu", None))
        with self.assertRaisesRegex(TypeError, r"`q_indices`.*torch\.int64.*torch\.int32"):
            msa_ptx.MSABackwardSchedule(*f)

    def test_wrong_shapes_are_value_errors(self):
        f = tiny_fields(row_ptr=([3, 2], [0, 5] * 3))
        with self.assertRaisesRegex(ValueError, r"`row_ptr`.*\[3, 2\].*\[4, rows \+ 1\]"):
            msa_ptx.MSABackwardSchedule(*f)
        f = tiny_fields(document_workspace_starts=([2], [0, 128]))
        with self.assertRaisesRegex(ValueError, r"`document_workspace_starts`.*\[documents\] = \[1\]"):
            msa_ptx.MSABackwardSchedule(*f)
        f = tiny_fields()
        f[3] = Fake([1], "torch.int32", ("cuda", 0))
        with self.assertRaisesRegex(ValueError, r"`work_count`.*one device"):
            msa_ptx.MSABackwardSchedule(*f)

    def test_bad_values_are_value_errors_naming_the_field(self):
        # Query 5 is past the 5-token document.
        f = tiny_fields(q_indices=([4, 5], [0, 1, 2, 3, 5] + list(range(5)) * 3))
        with self.assertRaisesRegex(ValueError, r"q_indices"):
            msa_ptx.MSABackwardSchedule(*f).validate()
        f = tiny_fields(cu_seqlens=([2], [1, 5]))
        with self.assertRaisesRegex(ValueError, r"cu_seqlens"):
            msa_ptx.MSABackwardSchedule(*f).validate()
        # Two work items covering the same edges of head 0.
        meta = [x for h in (0, 0, 2, 3) for x in (h, 0, 0, 5, 0, 0)]
        f = tiny_fields(scheduler_metadata=([4, 6], meta))
        with self.assertRaises(ValueError):
            msa_ptx.MSABackwardSchedule(*f).validate()

    def test_the_host_build_gives_the_hand_derived_tables(self):
        h = _native.HostSchedule.build(cpu_i32([4, T, 16], causal_q2k()), cpu_i32([2], [0, 5]))
        fields = {name: (shape, array.array("i", data).tolist())
                  for name, shape, data in h.fields()}
        self.assertEqual(fields["row_ptr"], ([4, 2], [0, 5] * 4))
        self.assertEqual(fields["cu_seqlens"], ([2], [0, 5]))
        self.assertEqual(fields["document_workspace_starts"], ([1], [0]))
        self.assertEqual(fields["work_count"], ([1], [4]))
        (heads, cap), q = fields["q_indices"]
        self.assertEqual([q[hd * cap: hd * cap + 5] for hd in range(4)], [list(range(5))] * 4)
        self.assertEqual(fields["scheduler_metadata"][1][:24],
                         [x for hd in range(4) for x in (hd, 0, 0, 5, 0, 0)])
        self.assertEqual((h.num_tokens, h.workspace_rows), (5, 128))

    def test_the_host_build_rejects_a_bad_selection(self):
        q2k = causal_q2k()
        q2k[1] = 0  # head 0, query 0, slot 1 repeats block 0
        with self.assertRaisesRegex(ValueError, r"q2k\[0,0,1\].*already selected at slot 0"):
            _native.HostSchedule.build(cpu_i32([4, T, 16], q2k), cpu_i32([2], [0, 5]))
        with self.assertRaisesRegex(ValueError, r"`q2k`.*\[4, T, 16\]"):
            _native.HostSchedule.build(cpu_i32([4, T, 8], [0] * 160), cpu_i32([2], [0, 5]))

    def test_the_device_build_checks_shapes_before_the_device(self):
        cu = Fake([2], "torch.int32")
        with self.assertRaisesRegex(TypeError, r"`q2k`.*torch\.int32"):
            _native.ResidentSchedule.build(Fake([4, T, 16], "torch.int64"), cu, 0)
        big = msa_ptx.MAX_BUILD_TOKENS + 1
        with self.assertRaisesRegex(ValueError, str(big)):
            _native.ResidentSchedule.build(Fake([4, big, 16], "torch.int32"), cu, 0)
        with self.assertRaisesRegex(NotImplementedError, r"`q2k`.*device type `cpu`"):
            _native.ResidentSchedule.build(cpu_i32([4, T, 16], causal_q2k()), cu, 0)


class Backward(unittest.TestCase):
    def setUp(self):
        self.schedule = msa_ptx.MSABackwardSchedule(*tiny_fields())

    def run_backward(self, args):
        return msa_ptx.run_backward(*args, self.schedule)

    def test_a_wrong_dtype_is_a_type_error(self):
        with self.assertRaisesRegex(TypeError, r"`q`.*torch\.float16.*torch\.bfloat16"):
            self.run_backward(backward_args(q=Fake([T, 64, 128], "torch.float16")))
        with self.assertRaisesRegex(TypeError, r"`lse`.*torch\.float32"):
            self.run_backward(backward_args(lse=Fake([T, 64])))

    def test_a_wrong_shape_is_a_value_error_with_the_schedule_sizes(self):
        with self.assertRaisesRegex(ValueError, r"`grad_out`.*\[6, 64, 128\].*T = 5"):
            self.run_backward(backward_args(grad_out=Fake([6, 64, 128])))
        with self.assertRaisesRegex(ValueError, r"`v_aligned`.*W = 128"):
            self.run_backward(backward_args(v_aligned=Fake([256, 4, 128])))

    def test_a_device_off_cuda_is_not_implemented(self):
        cpu = backward_args(out=Fake([T, 64, 128], device=("cpu", None)))
        with self.assertRaisesRegex(NotImplementedError, r"`out`.*device type `cpu`"):
            self.run_backward(cpu)

    def test_tensors_on_two_devices_are_a_value_error(self):
        with self.assertRaisesRegex(ValueError, r"`k_aligned`.*cuda:1.*cuda:0"):
            self.run_backward(backward_args(k_aligned=Fake([128, 4, 128], device=("cuda", 1))))

    def test_non_tensors_and_foreign_schedules_are_type_errors(self):
        with self.assertRaisesRegex(TypeError, r"`q`.*type list.*torch\.Tensor"):
            self.run_backward(backward_args(q=[1, 2, 3]))
        with self.assertRaisesRegex(TypeError, r"`schedule`.*MSABackwardSchedule"):
            msa_ptx.run_backward(*backward_args(), object())

    def test_the_deterministic_mode_runs_the_same_checks(self):
        with self.assertRaisesRegex(TypeError, r"`q`.*torch\.float16.*torch\.bfloat16"):
            msa_ptx.run_backward(*backward_args(q=Fake([T, 64, 128], "torch.float16")),
                                 self.schedule, deterministic=True)
        cpu = backward_args(out=Fake([T, 64, 128], device=("cpu", None)))
        with self.assertRaisesRegex(NotImplementedError, r"`out`.*device type `cpu`"):
            msa_ptx.run_backward(*cpu, self.schedule, deterministic=True)
        with self.assertRaisesRegex(TypeError, r"`deterministic`.*int.*bool"):
            msa_ptx.run_backward(*backward_args(), self.schedule, deterministic=1)

    def test_the_raw_entry_point_rejects_non_contiguous_and_misaligned_tensors(self):
        h = self.schedule.validate()._handle
        outs = [Fake([T, 64, 128]), Fake([128, 4, 128]), Fake([128, 4, 128])]
        strided = Fake([T, 64, 128], strides=(64 * 128, 1, 64))
        with self.assertRaisesRegex(ValueError, r"`q`.*contiguous"):
            _native.run_backward(*backward_args(q=strided), *outs, h, 0)
        odd = Fake([T, 64, 128], ptr=0x7F0000000008)
        with self.assertRaisesRegex(ValueError, r"`out`.*0x7f0000000008.*16 bytes"):
            _native.run_backward(*backward_args(out=odd), *outs, h, 0)

    def test_operand_copies_only_what_it_must(self):
        x = Fake([T, 64, 128])
        self.assertIs(msa_ptx._operand(x), x)
        self.assertEqual(msa_ptx._operand(Fake([T, 64, 128], strides=(1, T, T * 64))).copies, 1)
        self.assertEqual(msa_ptx._operand(Fake([T, 64, 128], ptr=0x7F0000000004)).copies, 1)


class Devices(unittest.TestCase):
    def test_non_cuda_devices_are_not_implemented(self):
        for dev in ("cpu", Device("cpu"), "mps:0"):
            with self.assertRaises(NotImplementedError):
                msa_ptx.sm_count(dev)
        with self.assertRaises(TypeError):
            msa_ptx.sm_count(1.5)

    @unittest.skipIf(_native.driver_present(), "a CUDA driver is installed here")
    def test_without_a_driver_the_device_queries_say_so(self):
        for f in (msa_ptx.sm_count, msa_ptx.sm_capability, msa_ptx.require_sm100):
            with self.assertRaisesRegex(RuntimeError, r"libcuda"):
                f("cuda:0")

    def test_the_forward_needs_a_schedule_built_on_the_device(self):
        h = msa_ptx.MSABackwardSchedule(*tiny_fields()).validate()._handle
        args = [Fake([T, 64, 128]), Fake([128, 4, 128]), Fake([128, 4, 128]),
                Fake([4, T, 16], "torch.int32"), Fake([T, 64, 128]), Fake([T, 64], "torch.float32")]
        with self.assertRaisesRegex(TypeError, r"`schedule`.*built on the device"):
            _native.run_forward(*args, h, 0)


class Forward(unittest.TestCase):
    """The forward's `algorithm` argument is checked before any work is enqueued."""

    def fwd_args(self):
        return [Fake([T, 64, 128]), Fake([128, 4, 128]), Fake([128, 4, 128]),
                Fake([4, T, 16], "torch.int32"), Fake([T, 64, 128]),
                Fake([T, 64], "torch.float32")]

    def test_an_unknown_algorithm_is_a_value_error_naming_it(self):
        for bad in ("fast", "KV_PARALLEL", ""):
            with self.assertRaisesRegex(ValueError, r"`algorithm`.*auto.*q_parallel.*kv_parallel"):
                msa_ptx.run_forward(*self.fwd_args()[:4], Fake([2], "torch.int32"),
                                    algorithm=bad)
            with self.assertRaisesRegex(ValueError, r"`algorithm`"):
                msa_ptx.msa_attention(*self.fwd_args()[:4], Fake([2], "torch.int32"),
                                      algorithm=bad)
        with self.assertRaisesRegex(TypeError, r"`algorithm`.*int"):
            msa_ptx.run_forward(*self.fwd_args()[:4], Fake([2], "torch.int32"), algorithm=1)
        self.assertEqual(msa_ptx.FORWARD_ALGORITHMS, ("auto", "q_parallel", "kv_parallel"))

    def test_the_native_forward_checks_the_algorithm_first(self):
        h = msa_ptx.MSABackwardSchedule(*tiny_fields()).validate()._handle
        with self.assertRaisesRegex(ValueError, r"argument `algorithm`: found \"kv\""):
            _native.run_forward(*self.fwd_args(), h, 0, "kv", False)
        # A known algorithm gets as far as the schedule check.
        for name in msa_ptx.FORWARD_ALGORITHMS:
            with self.assertRaisesRegex(TypeError, r"`schedule`.*built on the device"):
                _native.run_forward(*self.fwd_args(), h, 0, name, True)

    def test_clearing_the_caches_leaves_no_forward_workspace(self):
        msa_ptx.clear_workspace_cache()
        self.assertEqual(msa_ptx.forward_workspace_cache(), [])
        self.assertEqual(msa_ptx.workspace_cache(), [])


class ContextParallel(unittest.TestCase):
    """The rank layout of docs/design.md and runtime/src/cp.rs, derived by hand: documents of
    1000, 3000, 2500 and 1692 tokens hold 8 + 24 + 20 + 14 = 66 blocks of 128 (W = 8448); two
    ranks hold ceil(66/2) = 33 blocks each (S = 4224), so rank 0 ends after block 32, the
    first block of the third document (tokens 4000..4128)."""

    CU = [0, 1000, 4000, 6500, 8192]

    def test_the_layout_is_the_hand_derived_split(self):
        layout = msa_ptx.CPLayout(self.CU, 2)
        self.assertEqual((layout.ranks, layout.workspace_rows, layout.slice_rows,
                          layout.gathered_rows), (2, 8448, 4224, 8448))
        self.assertEqual([layout.token_rows(r) for r in (0, 1)], [(0, 4128), (4128, 8192)])
        self.assertEqual([layout.block_rows(r) for r in (0, 1)], [(0, 4224), (4224, 8448)])
        self.assertEqual(layout.local_cu_seqlens(0), [0, 1000, 4000, 4128])
        self.assertEqual(layout.local_cu_seqlens(1), [0, 2372, 4064])
        self.assertEqual(layout.cu_seqlens, self.CU)
        # Three ranks: 22 blocks each; rank 1 holds blocks 22..44: from block 14 of the second
        # document (token 1000 + 14*128) to block 12 of the third (token 4000 + 12*128).
        self.assertEqual(msa_ptx.CPLayout(self.CU, 3).token_rows(1), (2792, 5536))

    def test_bad_rank_counts_and_ranks_are_value_errors(self):
        with self.assertRaisesRegex(ValueError, r"`ranks`.*at least 1"):
            msa_ptx.CPLayout(self.CU, 0)
        with self.assertRaisesRegex(ValueError, r"`rank`.*2.*below 2"):
            msa_ptx.CPLayout(self.CU, 2).token_rows(2)
        with self.assertRaisesRegex(ValueError, r"cu_seqlens"):
            msa_ptx.CPLayout([0, 5, 3], 1)

    def test_a_rank_schedule_from_its_rows_of_the_selection(self):
        layout = msa_ptx.CPLayout(self.CU, 2)
        start, end = layout.token_rows(1)
        # Each query selects its own block (document-local ids of the whole document).
        q2k = []
        for _ in range(4):
            for t in range(start, end):
                doc = max(d for d in range(4) if self.CU[d] <= t)
                q2k += [(t - self.CU[doc]) // 128] + [-1] * 15
        h = layout.local_schedule(1, cpu_i32([4, end - start, 16], q2k))
        self.assertEqual(h.workspace_rows, 8448)
        q2k[16] = q2k[0] + 1  # the second query selects the block after its own
        with self.assertRaisesRegex(ValueError, r"q2k"):
            layout.local_schedule(1, cpu_i32([4, end - start, 16], q2k))
        with self.assertRaisesRegex(ValueError, r"`q2k_local`.*T_r = 4064"):
            layout.local_schedule(1, cpu_i32([4, 10, 16], [0] * 640))

    def test_the_rank_entry_points_check_shapes_before_any_collective(self):
        layout = msa_ptx.CPLayout(self.CU, 2)
        called = []
        gather = reduce = lambda *a: called.append(a)  # noqa: E731
        t, s = 4128, 4224
        q2k = cpu_i32([4, t, 16], [0] * (4 * t * 16))
        fwd = [Fake([t, 64, 128]), Fake([s, 4, 128]), Fake([s - 128, 4, 128]), q2k,
               Fake([t, 64, 128]), Fake([t, 64], "torch.float32")]
        with self.assertRaisesRegex(ValueError, r"`v_slice`.*S = 4224"):
            _native.cp_forward(layout, 0, *fwd, 0, gather)
        # A CUDA q2k_local (scheduled on the device) is checked like the other tensors.
        fwd[2] = Fake([s, 4, 128])
        fwd[3] = Fake([4, t + 1, 16], "torch.int32")
        with self.assertRaisesRegex(ValueError, r"`q2k_local`.*T_r = 4128"):
            _native.cp_forward(layout, 0, *fwd, 0, gather)
        h = msa_ptx.CPLayout([0, 128], 1).local_schedule(0, cpu_i32([4, 128, 16], [0, *[-1] * 15] * 512))
        bwd = [Fake([t, 64, 128]), Fake([s, 4, 128]), Fake([s, 4, 128]), Fake([t, 64, 128]),
               Fake([t, 64], "torch.float32"), Fake([t + 1, 64, 128]), Fake([t, 64, 128]),
               Fake([s, 4, 128]), Fake([s, 4, 128])]
        with self.assertRaisesRegex(ValueError, r"`out`.*T_r = 4128"):
            _native.cp_backward(layout, 0, *bwd, h, 0, gather, reduce)
        bwd[5] = Fake([t, 64, 128], "torch.float16")
        with self.assertRaisesRegex(TypeError, r"`out`"):
            _native.cp_backward(layout, 0, *bwd, h, 0, gather, reduce)
        with self.assertRaisesRegex(ValueError, r"`rank`"):
            _native.cp_backward(layout, 5, *bwd, h, 0, gather, reduce)
        with self.assertRaisesRegex(TypeError, r"`schedule`"):
            _native.cp_backward(layout, 0, *bwd, "a schedule", 0, gather, reduce)
        self.assertEqual(called, [])

    def test_the_group_status_needs_a_backward_on_that_stream(self):
        with self.assertRaisesRegex(RuntimeError, r"no cp_backward ran on cuda:0, stream 0x7"):
            _native.cp_backward_status(0, 7)

if __name__ == "__main__":
    unittest.main()
