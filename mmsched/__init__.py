"""mmsched."""
