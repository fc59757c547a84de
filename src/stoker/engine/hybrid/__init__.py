"""Decoding on both (``Config.decode_on="hybrid"``): each batch's chunks shared between the CPU engine and the
GPU decode (:mod:`.executor`), in shares from their measured rates (:mod:`.split`)."""
