"""spillway.install(): torch's CPU allocator routed by tag scope into a pageable MADV_DONTFORK arena,
and torch's pinned host allocator on a pinned arena whose blocks wait for recorded events. Each case
runs in a fresh interpreter: install() is once per process, as torch's allocator registry is."""
import subprocess
import sys
import textwrap


def run(code, expect_ok=True):
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    if expect_ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def test_tagged_allocations_land_in_the_arena_by_kind_and_untagged_ones_stay_torchs():
    run("""
        import torch, spillway
        rt = spillway.install()
        outside = torch.empty(1 << 20)
        with spillway.tag("optimizer_state"):
            state = torch.zeros(1 << 20)
            tiny = torch.zeros(16)              # below small_bytes: torch's
            with spillway.tag("grad"):          # the innermost scope wins
                g = torch.ones(1 << 18)
        assert rt.host.contains(state.data_ptr(), state.nbytes)
        assert rt.host.contains(g.data_ptr(), g.nbytes)
        assert not rt.host.contains(outside.data_ptr(), 4) and not rt.host.contains(tiny.data_ptr(), 4)
        kinds = rt.host.stats()["live_by_kind"]
        assert kinds["optimizer_state"] == 4 << 20 and kinds["grad"] == 1 << 20, kinds
        assert rt.host.stats()["fork_safety"] == "dontfork" and rt.host.stats()["pin_mode"] == "pageable"
        del state
        assert rt.host.stats()["live_by_kind"]["optimizer_state"] == 0
        assert spillway._spillway._torch_allocators_are_spillways() == (True, True)
    """)


def test_a_tag_reaches_threads_torch_propagates_its_thread_local_state_to():
    # torch.jit.fork runs on torch's inter-op pool under ThreadLocalStateGuard, as autograd's
    # device threads do: a plain thread_local would not be seen there.
    run("""
        import torch, spillway
        rt = spillway.install()
        def make():
            return torch.zeros(1 << 20)
        with spillway.tag("transient"):
            t = torch.jit.wait(torch.jit.fork(make))
        assert rt.host.contains(t.data_ptr(), t.nbytes)
        w = torch.randn(1024, 1024, requires_grad=True)
        with spillway.tag("grad"):
            (w * 3).sum().backward()
        assert rt.host.contains(w.grad.data_ptr(), w.grad.nbytes)
    """)


def test_bad_input_install_twice_tag_before_install_and_scopes_out_of_order():
    run("""
        import torch, spillway
        try:
            with spillway.tag("grad"):
                pass
        except spillway.FailedPrecondition as e:
            assert "before spillway.install()" in str(e), e
        else:
            raise AssertionError("tag before install was accepted")
        rt = spillway.install()
        try:
            spillway.install()
        except spillway.FailedPrecondition as e:
            assert "already called" in str(e), e
        else:
            raise AssertionError("install twice was accepted")
        assert spillway.installed() is rt
        outer, inner = spillway.tag("param"), spillway.tag("grad")
        outer.__enter__(); inner.__enter__()
        try:
            outer.__exit__(None, None, None)
        except spillway.FailedPrecondition as e:
            assert "reverse order" in str(e) and "grad/persistent" in str(e), e
        else:
            raise AssertionError("out-of-order exit was accepted")
        # Nothing changed: the inner scope is still the current one and still serves allocations.
        assert spillway._spillway._current_tag() == "grad/persistent"
        g = torch.zeros(1 << 18)
        assert rt.host.stats()["live_by_kind"]["grad"] == 1 << 20
        inner.__exit__(None, None, None); outer.__exit__(None, None, None)
        assert spillway._spillway._current_tag() is None
    """)


def test_bad_input_a_torch_other_than_the_one_built_against_is_refused_and_nothing_is_installed():
    run("""
        import torch, spillway
        torch.__version__ = "2.99.0+cpu"
        try:
            spillway.install()
        except spillway.FailedPrecondition as e:
            assert "2.99.0" in str(e) and "Rebuild" in str(e) and "Still" in str(e), e
        else:
            raise AssertionError("a mismatched torch was accepted")
        assert spillway.installed() is None
        assert spillway._spillway._torch_allocators_are_spillways() == (False, False)
    """)


def test_a_forked_childs_tagged_allocations_come_from_an_arena_of_its_own():
    """A process forked after install() (DeepSpeed's test harness, fork-start pools) that allocates
    inside a tag scope gets an arena of its own, made on first use; the parent's tensors it drops
    are left alone (their memory is not mapped there), and a grandchild makes its own again."""
    run("""
        import os, torch, spillway
        rt = spillway.install()
        stats = spillway._spillway._router_stats
        with spillway.tag("optimizer_state"):
            keep = torch.full((1 << 20,), 7.0)
            pid = os.fork()
            if pid == 0:
                torch.set_num_threads(1)  # libgomp's pool hangs in a forked child (DataLoader does this too)
                code = 3
                try:
                    assert "child_live_bytes" not in stats()          # made on first use only
                    mine = torch.full((1 << 20,), 3.0)                # the child's own arena
                    assert float(mine.sum()) == 3.0 * (1 << 20)
                    assert stats()["child_live_bytes"] >= 4 << 20, stats()
                    assert stats()["child_budget_bytes"] == rt.host.stats()["budget_bytes"]
                    code = 4
                    del keep                                          # the parent's: left alone
                    again = torch.ones(1 << 20)
                    assert float(again.sum()) == float(1 << 20)
                    del mine, again
                    assert stats()["child_live_bytes"] == 0, stats()
                    code = 5
                    theirs = torch.full((1 << 18,), 2.0)
                    gpid = os.fork()
                    if gpid == 0:
                        gcode = 6
                        try:
                            assert "child_live_bytes" not in stats()  # the grandchild makes its own
                            own = torch.full((1 << 18,), 9.0)
                            del theirs                                # its parent's: left alone
                            assert float(own.sum()) == 9.0 * (1 << 18) and stats()["child_live_bytes"] >= 1 << 20
                            gcode = 0
                        except BaseException as e:
                            print(f"grandchild failed at {gcode}: {type(e).__name__}: {e}", flush=True)
                        os._exit(gcode)
                    _, gstatus = os.waitpid(gpid, 0)
                    assert os.waitstatus_to_exitcode(gstatus) == 0, gstatus
                    assert float(theirs.sum()) == 2.0 * (1 << 18)      # the child's own data is intact
                    code = 7
                    try:                                              # pinned memory stays the parent's
                        spillway._spillway._host_allocator_empty(1 << 16)
                    except RuntimeError as e:
                        code = 0 if "forked" in str(e) and "spawn" in str(e) else 8
                except BaseException as e:
                    print(f"child failed at {code}: {type(e).__name__}: {e}", flush=True)
                os._exit(code)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert float(keep.sum()) == 7.0 * (1 << 20)   # the parent's data is intact
        assert rt.host.contains(keep.data_ptr(), keep.nbytes)
        assert "child_live_bytes" not in stats()       # the parent never made one
        outside = torch.arange(1000.)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if float(outside.sum()) == 499500.0 and float(torch.ones(8).sum()) == 8 else 5)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "memory made outside a scope is the child's to read"
    """)


def test_a_grandchild_dropping_its_parents_tagged_tensor_never_frees_its_own():
    """The child's arena is MADV_WIPEONFORK: in a grandchild its ranges stay mapped (zero pages),
    so the grandchild's own arena cannot be placed at the same addresses and an inherited storage
    that dies there cannot free the grandchild's memory. (With MADV_DONTFORK the grandchild's
    arena took the hole the child's left, `own` got the address of `theirs`, and `del theirs`
    freed `own` while it was in use: found in review.)"""
    run("""
        import os, torch, spillway
        rt = spillway.install()
        stats = spillway._spillway._router_stats
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            code = 3
            with spillway.tag("optimizer_state"):
                theirs = torch.full((1 << 18,), 2.0)
                gpid = os.fork()
                if gpid == 0:
                    gcode = 4
                    try:
                        own = torch.full((1 << 18,), 9.0)
                        live = stats()["child_live_bytes"]
                        assert own.data_ptr() != theirs.data_ptr(), "the grandchild's arena reused the child's range"
                        del theirs
                        assert stats()["child_live_bytes"] == live, (live, stats())
                        again = torch.full((1 << 18,), 5.0)  # would land on `own` if it had been freed
                        assert float(own.sum()) == 9.0 * (1 << 18) and float(again.sum()) == 5.0 * (1 << 18)
                        gcode = 0
                    except BaseException as e:
                        print(f"grandchild failed at {gcode}: {type(e).__name__}: {e}", flush=True)
                    os._exit(gcode)
                _, gstatus = os.waitpid(gpid, 0)
                code = os.waitstatus_to_exitcode(gstatus)
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
    """)


def test_bad_input_over_budget_is_spillways_error_and_names_the_budget():
    run("""
        import torch, spillway
        rt = spillway.install(budget_bytes=8 << 20)
        keep = None
        with spillway.tag("param"):
            keep = torch.ones(1 << 20)
        try:
            with spillway.tag("optimizer_state"):
                torch.zeros(4 << 20)
        except spillway.OverBudget as e:
            assert "budget" in str(e) and "optimizer_state" in str(e), e
        else:
            raise AssertionError("over budget was accepted")
        assert float(keep.sum()) == 1 << 20 and rt.host.stats()["live_by_kind"]["optimizer_state"] == 0
    """)


PINNED = """
    import torch, spillway
    sw = spillway._spillway
    rt = spillway.install()
    sw._testing_manual_events(True)   # no GPU here: events complete when the test says (docs/deepspeed.md)
"""


def test_a_forked_child_reads_pageable_memory_but_pinned_memory_made_outside_any_scope_is_not_mapped_there():
    # What docs/deepspeed.md ("The fork restriction") says: every pinned allocation after install(),
    # in a scope or not (a pinned dataset, pin_memory() outside any tag), is the pinned arena's,
    # MADV_DONTFORK, so a forked DataLoader worker that reads it dies with SIGSEGV; a pageable copy
    # made before the fork is the child's to read.
    p = run(PINNED + """
    import os
    pinned = sw._host_allocator_empty(1 << 16)      # outside any scope
    assert rt.pinned.contains(pinned.data_ptr(), 1 << 16)
    pinned.fill_(3)
    pageable = pinned.clone()                         # torch's memory: inherited as usual
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)
        ok = int(pageable.sum()) == 3 * (1 << 16)
        os.write(1, b"pageable read\\n" if ok else b"pageable wrong\\n")
        int(pinned.sum())                             # not mapped in the child
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status))
    """)
    assert "pageable read" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "child exit -11" in p.stdout, p.stdout + p.stderr[-3000:]


def test_pinned_blocks_come_from_the_pinned_arena_exact_size_and_foreign_memory_is_forwarded():
    run(PINNED + """
    a = sw._host_allocator_empty(12345)
    assert rt.pinned.contains(a.data_ptr(), 12345) and sw._pinned_stats()["live_bytes"] == 12345
    assert not sw._host_allocator_record_event(torch.empty(100))      # not ours: forwarded
    assert sw._pinned_stats()["foreign_record_events_total"] == 1
    s = sw._host_allocator_stats()
    assert s["active_bytes"] == 12345 and s["active_requests"] == 1, s
    del a
    assert sw._pinned_stats()["live_bytes"] == 0 and rt.pinned.stats()["live_bytes"] == 0
    """)


def test_a_block_with_a_pending_event_is_not_reused_until_the_event_completes():
    run(PINNED + """
    a = sw._host_allocator_empty(1 << 20)
    addr = a.data_ptr()
    assert sw._host_allocator_record_event(a)      # a non_blocking copy reads it
    del a                                          # freed while the copy may still run
    st = sw._pinned_stats()
    assert st["deferred_blocks"] == 1 and st["deferred_bytes"] == 1 << 20, st
    b = sw._host_allocator_empty(1 << 20)
    assert b.data_ptr() != addr, "a block with a pending event was handed out again"
    assert rt.pinned.stats()["live_bytes"] == 2 << 20
    sw._testing_complete_events()
    assert sw._poll_deferred() == 1
    assert sw._pinned_stats()["deferred_blocks"] == 0 and rt.pinned.stats()["live_bytes"] == 1 << 20
    """)


def test_arena_empty_tensors_defer_their_free_the_same_way():
    run(PINNED + """
    arena = spillway.HostArena(pinned=False, name="own")
    t = arena.empty((1 << 18,), torch.float32, kind="swap_buffer", lifetime="persistent")
    assert sw._host_allocator_record_event(t)
    del t
    assert arena.stats()["live_bytes"] == 1 << 20, "freed under a pending copy"
    sw._testing_complete_events(); sw._poll_deferred()
    assert arena.stats()["live_bytes"] == 0
    """)


def test_graph_pool_blocks_are_held_until_every_graph_released_the_pool_and_used_ones_for_good():
    run(PINNED + """
    pool = sw._host_allocator_pool
    pool("begin", 1, 2)                           # two graphs share pool (1, 2)
    pool("end", 1, 2)
    pool("begin", 1, 2)
    unused = sw._host_allocator_empty(4096)
    used = sw._host_allocator_empty(8192)
    assert sw._host_allocator_record_event(used)  # during capture: a graph reads it
    pool("end", 1, 2)
    del unused, used
    st = sw._pinned_stats()
    assert st["deferred_blocks"] == 1 and st["graph_held_blocks"] == 1, st
    sw._host_allocator_empty_cache()
    pool("release", 1, 2)                         # the first graph is reset: the other still uses it
    assert sw._pinned_stats()["deferred_blocks"] == 1, "a pool block was freed while a graph used the pool"
    pool("release", 1, 2)
    st = sw._pinned_stats()
    assert st["deferred_blocks"] == 0 and st["graph_held_bytes"] == 8192, st
    assert rt.pinned.stats()["live_bytes"] == 8192   # the used block is never reused, as in torch
    """)


def test_a_buffer_copied_every_step_collects_no_events_one_per_stream_at_free():
    run(PINNED + """
    a = sw._host_allocator_empty(1 << 16)
    for _ in range(1000):
        assert sw._host_allocator_record_event(a)
    assert sw._pinned_stats()["events_recorded_total"] == 0   # noted streams, recorded nothing yet
    del a
    st = sw._pinned_stats()
    assert st["events_recorded_total"] == 1 and st["deferred_blocks"] == 1, st
    """)


def test_default_budgets_share_three_quarters_of_the_memory_limit_and_overbudget_is_torchs_oom_too():
    # Outside a node ledger (SPILLWAY_NODE=0): in one, both budgets are the node's (test_node_api.py).
    run("""
        import os
        os.environ["SPILLWAY_NODE"] = "0"
        import torch, spillway
        rt = spillway.install()
        assert not spillway.node.joined()
        total = spillway.default_host_budget()
        assert total == spillway.memory_limit_bytes() // 4 * 3
        page = 4096
        host, pinned = rt.host.stats()["budget_bytes"], rt.pinned.stats()["budget_bytes"]
        assert abs(host + pinned - total) <= 2 * page, (host, pinned, total)
        assert issubclass(spillway.OverBudget, torch.OutOfMemoryError)
        assert issubclass(spillway.OverBudget, MemoryError) and issubclass(spillway.OverBudget, spillway.Error)
    """)
