"""Media inputs: URLs to bytes, images and videos decoded under limits, frames sampled into
patches (see the parent package's map)."""
