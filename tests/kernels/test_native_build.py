"""Which CPU forms the native build compiles: ``cpu`` (``make native``: the forms this machine
runs), ``all`` (the wheel: every form the compiler compiles), or a list; reasons when it cannot."""

from __future__ import annotations

import pytest

from pagedhybrid.kernels import native
from pagedhybrid.kernels.native import build


def test_an_x86_64_gcc_compiles_every_form_fastest_first() -> None:
    assert build.compilable_forms() == tuple(native.FORMS)
    assert build.select_forms("all") == tuple(native.FORMS)


def test_cpu_builds_the_forms_this_machine_runs() -> None:
    assert build.select_forms("cpu") == native.runnable_forms()


def test_a_list_is_built_fastest_first() -> None:
    assert build.select_forms("avx2, avx512") == ("avx512", "avx2")


def test_a_compiler_that_refuses_the_flags_compiles_no_form() -> None:
    assert build.compilable_forms("false") == ()
    assert build.compilable_forms("no-such-compiler") == ()


@pytest.mark.parametrize("spec", ["sse4", "none", "avx2,avx9"])
def test_an_unknown_form_is_refused_with_the_choices(spec: str) -> None:
    with pytest.raises(SystemExit, match=r"is not a CPU form .*avx512_bf16.*cpu / all"):
        build.select_forms(spec)
