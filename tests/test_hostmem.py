"""In-place pinning registrations (``hostmem``) follow their storages' lifetimes."""

from __future__ import annotations

import threading

import torch

from diffusion_offload.core import hostmem


class _Platform:
    """A platform stub that records registrations; ``on_register`` runs inside them."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", 0)  # only its type keys the registrations
        self.live: set[int] = set()
        self.on_register = None

    def host_register(self, ptr: int, nbytes: int) -> bool:
        if self.on_register is not None:
            self.on_register()
        self.live.add(ptr)
        return True

    def host_unregister(self, ptr: int) -> None:
        self.live.discard(ptr)


def test_registration_lives_as_long_as_the_storage():
    platform = _Platform()
    t = torch.ones(1000)
    view = t[10:20]
    assert hostmem.pin_in_place(platform, t.untyped_storage())
    assert hostmem.pin_in_place(platform, view.untyped_storage())  # already: no second one
    assert platform.live == {t.data_ptr()}
    del t
    assert platform.live  # the view keeps the storage, and so the registration
    del view
    assert platform.live == set()


def test_a_storage_freed_while_registering_another_does_not_deadlock():
    platform = _Platform()
    holder = [torch.ones(1000)]
    assert hostmem.pin_in_place(platform, holder[0].untyped_storage())
    # freeing the first storage runs its unregister finalizer inside the second registration
    platform.on_register = holder.clear
    second = torch.ones(2000)
    done = threading.Event()

    def register() -> None:
        hostmem.pin_in_place(platform, second.untyped_storage())
        done.set()

    worker = threading.Thread(target=register, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert done.is_set(), "pin_in_place deadlocked on a finalizer run inside it"
    assert platform.live == {second.data_ptr()}


def test_unpin_in_place_undoes_a_registration():
    platform = _Platform()
    t = torch.ones(100)
    assert hostmem.pin_in_place(platform, t.untyped_storage())
    hostmem.unpin_in_place(platform, t.untyped_storage())
    assert platform.live == set()
    assert hostmem.pin_in_place(platform, t.untyped_storage())  # and it can register again
