"""Adapters that plug posattn into other frameworks; the core ``posattn`` package imports none of them."""
