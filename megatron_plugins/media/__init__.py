"""Media as the data sources and the encoders exchange it: decoding and encoding sample parts
(:mod:`.codec`: images, videos, WAV audio, text) and the mock data's media (:mod:`.mock`).

Below both ``data`` and ``encoders``: an encoder's preprocessor takes decoded media, and the
dataset tools write with the codec the loader reads with. Nothing is imported here.
"""

__all__ = []
