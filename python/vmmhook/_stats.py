"""vmmhook.memory_stats(): the library's statistics (vmm_stats_json) in the names of
torch.cuda.memory_stats(), where a meaning matches, plus the tag figures of docs/SLEEP.md.

What each PyTorch name means here (the library serves device memory; PyTorch's caching
allocator, if in front of it, is not seen: its blocks are inside the buffers counted here):

| key | tag None (the process) | one tag |
| --- | --- | --- |
| allocated_bytes.all.current, .peak | live served buffers, bytes asked for (gauge bytes_requested) | the tag's requested, requested_peak |
| requested_bytes.all.current, .peak | the same (the library does not count its rounding apart) | the same |
| reserved_bytes.all.current, .peak | device memory mapped, cached idle memory included (bytes_mapped) | the tag's mapped (.current only) |
| cached_bytes.current, .peak (no PyTorch name) | idle memory kept for reuse, releasable (bytes_cached; PyTorch's inactive_split_bytes are not releasable, so not that name) | - |
| allocation.all.allocated, .freed, .current | served allocations, frees, live buffers (counters) | - |
| num_alloc_retries | allocations retried after giving idle memory back (oom_retries) | - |
| num_ooms | served allocations answered out of memory after that retry (ooms) | - |
| num_sync_all_streams | context synchronizations by the library (syncs) | - |

"tag.*" keys: the figures of docs/SLEEP.md (tag.state, tag.paused, tag.backed_up,
tag.kept_mapped, tag.spilled, tag.pauses, tag.resumes, tag.pause_ns, tag.resume_ns, tag.last_pause_ns,
tag.last_resume_ns) for one tag; summed over every tag for tag None (tag.state then counts:
tag.paused_tags, tag.running_tags). "pinned_host_bytes.current", ".peak": host memory kept
pinned for backups (process-wide, in both cases).
"""

_TAG_FIGURES = ("paused", "backed_up", "kept_mapped", "spilled", "pauses", "resumes", "pause_ns",
                "resume_ns", "last_pause_ns", "last_resume_ns")


def _gauge(stats, name):
    g = stats.get("gauges", {}).get(name)
    return (g["current"], g["peak"]) if g else (None, None)


def torch_names(stats, tag=None):
    """The dict memory_stats() returns, from the dict stats() returns. KeyError for a tag
    the library does not know (never pushed)."""
    out = {}
    tags = stats.get("tags", {})
    pinned = stats.get("pinned_host_bytes", {})
    out["pinned_host_bytes.current"] = pinned.get("current", 0)
    out["pinned_host_bytes.peak"] = pinned.get("peak", 0)
    if tag is not None:
        if tag not in tags:
            raise KeyError(f"no tag {tag!r} in the library (tags: {', '.join(sorted(tags))})")
        t = tags[tag]
        out["allocated_bytes.all.current"] = t["requested"]
        out["allocated_bytes.all.peak"] = t["requested_peak"]
        out["requested_bytes.all.current"] = t["requested"]
        out["requested_bytes.all.peak"] = t["requested_peak"]
        out["reserved_bytes.all.current"] = t["mapped"]
        out["tag.state"] = t["state"]
        for k in _TAG_FIGURES:
            out["tag." + k] = t.get(k, 0)
        return dict(sorted(out.items()))

    counters = stats.get("counters", {})
    cur, peak = _gauge(stats, "bytes_requested")
    for name in ("allocated_bytes", "requested_bytes"):
        out[name + ".all.current"] = cur
        out[name + ".all.peak"] = peak
    cur, peak = _gauge(stats, "bytes_mapped")
    out["reserved_bytes.all.current"] = cur
    out["reserved_bytes.all.peak"] = peak
    cur, peak = _gauge(stats, "bytes_cached")
    out["cached_bytes.current"] = cur
    out["cached_bytes.peak"] = peak
    allocs = counters.get("served_allocs", 0)
    frees = counters.get("served_frees", 0)
    out["allocation.all.allocated"] = allocs
    out["allocation.all.freed"] = frees
    out["allocation.all.current"] = allocs - frees
    out["num_alloc_retries"] = counters.get("oom_retries", 0)
    if "ooms" in counters:  # a library older than the counter leaves it out rather than lie
        out["num_ooms"] = counters["ooms"]
    out["num_sync_all_streams"] = counters.get("syncs", 0)
    for k in _TAG_FIGURES:
        out["tag." + k] = sum(t.get(k, 0) for t in tags.values())
    out["tag.paused_tags"] = sum(1 for t in tags.values() if t["state"] != "running")
    out["tag.running_tags"] = sum(1 for t in tags.values() if t["state"] == "running")
    return dict(sorted(out.items()))
