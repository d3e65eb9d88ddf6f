/* The ring core: layout, push/peek/advance and kernel waits. See ring.h for the layout. */
#define _GNU_SOURCE
#include "ring.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HDR ((uint64_t)sizeof(og_record_header))

_Static_assert(sizeof(og_record_header) == 32, "record header is 32 bytes");
_Static_assert(sizeof(og_ring_shared) == 6 * OG_CACHE_LINE, "ring header layout");
_Static_assert(sizeof(og_control_shared) == OG_CACHE_LINE, "control header layout");

static inline uint64_t align_up(uint64_t n) {
    return (n + OG_RECORD_ALIGN - 1) & ~(uint64_t)(OG_RECORD_ALIGN - 1);
}

uint64_t og_monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no syscall */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

size_t og_ring_segment_size(uint64_t capacity) {
    return sizeof(og_ring_shared) + (size_t)capacity;
}

size_t og_control_segment_size(uint32_t max_sessions) {
    return sizeof(og_control_shared) + 2 * (size_t)max_sessions * sizeof(uint32_t);
}

/* A record may take at most half the ring, so that one always fits once the ring drains,
 * wherever the head happens to be. */
uint64_t og_ring_max_payload(uint64_t capacity) {
    return capacity / 2 - HDR;
}

void og_ring_init(void *base, uint64_t capacity, int32_t owner_pid) {
    og_ring_shared *s = base;
    memset(s, 0, sizeof(*s));
    s->meta.version = OG_LAYOUT_VERSION;
    s->meta.meta_size = sizeof(og_ring_shared);
    s->meta.capacity = capacity;
    s->meta.owner_pid = owner_pid;
    s->meta.created_ns = og_monotonic_ns();
    /* magic last: a peer that attaches mid-initialisation sees a bad magic, not garbage */
    atomic_thread_fence(memory_order_release);
    __atomic_store_n(&s->meta.magic, OG_RING_MAGIC, __ATOMIC_RELEASE);
}

void og_control_init(void *base, uint32_t max_sessions, int32_t owner_pid) {
    og_control_shared *c = base;
    memset(c, 0, og_control_segment_size(max_sessions));
    c->version = OG_LAYOUT_VERSION;
    c->max_sessions = max_sessions;
    c->owner_pid = owner_pid;
    c->created_ns = og_monotonic_ns();
    __atomic_store_n(&c->magic, OG_CONTROL_MAGIC, __ATOMIC_RELEASE);
}

og_status og_ring_open(og_ring *ring, void *base, size_t segment_size) {
    og_ring_shared *s = base;
    if (segment_size < sizeof(og_ring_shared))
        return OG_BAD_SIZE;
    if (__atomic_load_n(&s->meta.magic, __ATOMIC_ACQUIRE) != OG_RING_MAGIC)
        return OG_BAD_MAGIC;
    if (s->meta.version != OG_LAYOUT_VERSION || s->meta.meta_size != sizeof(og_ring_shared))
        return OG_BAD_VERSION;
    uint64_t cap = s->meta.capacity;
    if (cap < 2 * (HDR + OG_RECORD_ALIGN) || (cap & (cap - 1)) != 0 ||
        segment_size < og_ring_segment_size(cap))
        return OG_BAD_SIZE;
    ring->shared = s;
    ring->data = (uint8_t *)base + sizeof(og_ring_shared);
    ring->mask = cap - 1;
    ring->control = NULL;
    ring->peek_end = 0;
    ring->wake_yield = 0;
    ring->last_wake_ns = 0;
    return OG_OK;
}

og_status og_control_open(og_control_shared *c, size_t segment_size) {
    if (segment_size < sizeof(og_control_shared))
        return OG_BAD_SIZE;
    if (__atomic_load_n(&c->magic, __ATOMIC_ACQUIRE) != OG_CONTROL_MAGIC)
        return OG_BAD_MAGIC;
    if (c->version != OG_LAYOUT_VERSION)
        return OG_BAD_VERSION;
    if (segment_size < og_control_segment_size(c->max_sessions))
        return OG_BAD_SIZE;
    return OG_OK;
}

og_status og_control_epoch(og_control_shared *c, uint32_t session, uint32_t *epoch) {
    if (session >= c->max_sessions)
        return OG_BAD_SESSION;
    *epoch = atomic_load_explicit(&c->epochs[session], memory_order_acquire);
    return OG_OK;
}

og_status og_control_cancel(og_control_shared *c, uint32_t session, uint32_t *new_epoch) {
    if (session >= c->max_sessions)
        return OG_BAD_SESSION;
    *new_epoch = atomic_fetch_add_explicit(&c->epochs[session], 1, memory_order_acq_rel) + 1;
    return OG_OK;
}

og_status og_control_advance(og_control_shared *c, uint32_t session, uint32_t epoch,
                             uint32_t *now) {
    if (session >= c->max_sessions)
        return OG_BAD_SESSION;
    uint32_t current = atomic_load_explicit(&c->epochs[session], memory_order_acquire);
    /* older(current, epoch): current comes before epoch, modulo 2**32 */
    while ((uint32_t)(current - epoch) >= 0x80000000u) {
        if (atomic_compare_exchange_weak_explicit(&c->epochs[session], &current, epoch,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            current = epoch;
            break;
        }
    }
    *now = current;
    return OG_OK;
}

static inline _Atomic uint32_t *slot_of(og_control_shared *c, uint32_t session) {
    return &c->epochs[c->max_sessions + session];
}

og_status og_control_claim(og_control_shared *c, int32_t holder_pid, uint32_t first, uint32_t step,
                           uint32_t *session) {
    if (step == 0)
        return OG_BAD_SESSION;
    for (uint32_t s = first; s < c->max_sessions; s += step) {
        uint32_t expected = OG_SLOT_FREE;
        if (atomic_compare_exchange_strong(slot_of(c, s), &expected, (uint32_t)holder_pid)) {
            atomic_fetch_add_explicit(&c->epochs[s], 1, memory_order_acq_rel);
            *session = s;
            return OG_OK;
        }
    }
    return OG_NO_SLOT;
}

og_status og_control_release(og_control_shared *c, uint32_t session) {
    if (session >= c->max_sessions)
        return OG_BAD_SESSION;
    /* bump first: whatever the old holder left queued is stale before the slot is reused */
    atomic_fetch_add_explicit(&c->epochs[session], 1, memory_order_acq_rel);
    atomic_store_explicit(slot_of(c, session), OG_SLOT_FREE, memory_order_release);
    return OG_OK;
}

og_status og_control_holder(og_control_shared *c, uint32_t session, int32_t *holder_pid) {
    if (session >= c->max_sessions)
        return OG_BAD_SESSION;
    *holder_pid = (int32_t)atomic_load_explicit(slot_of(c, session), memory_order_acquire);
    return OG_OK;
}

/* ---- kernel waits ---------------------------------------------------------------------- */

static long futex_wait(_Atomic uint32_t *word, uint32_t expected, int64_t timeout_ns) {
    struct timespec ts, *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = timeout_ns / 1000000000;
        ts.tv_nsec = timeout_ns % 1000000000;
        tsp = &ts;
    }
    /* not FUTEX_PRIVATE: the word lives in memory shared between processes */
    return syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, tsp, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 1, NULL, NULL, 0);
}

/* Wake the other side only if it announced that it sleeps: one load on the fast path, a
 * syscall only for a sleeper. Pairs with the store-then-recheck in sleep_on(). */
static inline int wake_if_sleeping(_Atomic uint32_t *sleeping) {
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(sleeping, memory_order_relaxed) &&
        atomic_exchange_explicit(sleeping, 0, memory_order_acq_rel)) {
        futex_wake(sleeping);
        return 1;
    }
    return 0;
}

int og_pid_alive(int32_t pid) {
    if (pid <= 0)
        return 1; /* unknown peer: nothing to say */
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    /* a killed child that its parent has not reaped yet still answers kill(): ask /proc */
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return errno == ENOENT ? 0 : 1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'))
        return 0;
    return 1;
}

typedef int (*ready_fn)(og_ring *ring, uint64_t arg);

/* Announce sleep, re-check, sleep. OG_OK means "look again" (data may have arrived, or a
 * spurious wake-up); OG_TIMEOUT means the slice passed with nothing to do. */
static og_status sleep_on(og_ring *ring, _Atomic uint32_t *sleeping, ready_fn ready,
                          uint64_t arg, int64_t timeout_ns, _Atomic int32_t *peer_pid) {
    if (ready(ring, arg))
        return OG_OK;
    if (timeout_ns == 0)
        return OG_TIMEOUT;
    atomic_store_explicit(sleeping, 1, memory_order_seq_cst);
    atomic_thread_fence(memory_order_seq_cst);
    if (ready(ring, arg)) {
        atomic_store_explicit(sleeping, 0, memory_order_relaxed);
        return OG_OK;
    }
    long rc = futex_wait(sleeping, 1, timeout_ns);
    int err = rc == 0 ? 0 : errno;
    atomic_store_explicit(sleeping, 0, memory_order_relaxed);
    if (err == EINTR)
        return OG_INTERRUPTED;
    if (ready(ring, arg))
        return OG_OK;
    if (err == ETIMEDOUT) {
        int32_t pid = atomic_load_explicit(peer_pid, memory_order_relaxed);
        if (!og_pid_alive(pid)) {
            /* report a dead peer once; a restarted peer registers itself again */
            atomic_compare_exchange_strong(peer_pid, &pid, 0);
            return OG_PEER_DIED;
        }
        return OG_TIMEOUT;
    }
    return OG_OK;
}

/* ---- producer -------------------------------------------------------------------------- */

/* Bytes the record needs from head onwards, wrap gap included. */
static inline uint64_t bytes_needed(og_ring *ring, uint64_t head, uint64_t total) {
    uint64_t contiguous = ring->mask + 1 - (head & ring->mask);
    return contiguous < total ? contiguous + total : total;
}

static int has_room(og_ring *ring, uint64_t length) {
    og_ring_shared *s = ring->shared;
    uint64_t head = atomic_load_explicit(&s->prod.head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&s->cons.tail, memory_order_acquire);
    uint64_t free_bytes = ring->mask + 1 - (head - tail);
    return bytes_needed(ring, head, align_up(HDR + length)) <= free_bytes;
}

og_status og_ring_push(og_ring *ring, og_record_header *hdr, const void *payload,
                       uint32_t length) {
    og_ring_shared *s = ring->shared;
    uint64_t cap = ring->mask + 1;
    uint64_t total = align_up(HDR + length);
    if (length > og_ring_max_payload(cap))
        return OG_TOO_BIG;
    uint64_t head = atomic_load_explicit(&s->prod.head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&s->cons.tail, memory_order_acquire);
    if (bytes_needed(ring, head, total) > cap - (head - tail))
        return OG_FULL;
    uint64_t off = head & ring->mask;
    uint64_t contiguous = cap - off;
    if (contiguous < total) {
        if (contiguous >= HDR) {
            og_record_header wrap = {.length = (uint32_t)(contiguous - HDR), .kind = OG_KIND_WRAP};
            memcpy(ring->data + off, &wrap, HDR);
        }
        head += contiguous;
        off = 0;
    }
    uint64_t seq = atomic_load_explicit(&s->prod.pushed, memory_order_relaxed);
    hdr->length = length;
    hdr->seq = seq;
    hdr->t_ns = og_monotonic_ns();
    memcpy(ring->data + off, hdr, HDR);
    if (length)
        memcpy(ring->data + off + HDR, payload, length);
    atomic_store_explicit(&s->prod.pushed, seq + 1, memory_order_relaxed);
    atomic_store_explicit(&s->prod.head, head + total, memory_order_release);
    /* The scheduler usually queues the woken consumer on this very CPU (waking the other,
     * halted vCPU costs more), where it waits until the producer blocks or is preempted: a
     * variable 5-30 us. With wake_yield the producer yields so that it runs now (a no-op when
     * it went elsewhere), only for a wake that ends a quiet spell: in a burst, yielding on
     * every wake turns the ring into a record-by-record ping-pong (10x fewer records/s). */
    if (wake_if_sleeping(&s->cons.sleeping) && ring->wake_yield) {
        if (hdr->t_ns - ring->last_wake_ns > OG_YIELD_AFTER_NS)
            sched_yield();
        ring->last_wake_ns = hdr->t_ns;
    }
    return OG_OK;
}

void og_ring_count_full(og_ring *ring) {
    atomic_fetch_add_explicit(&ring->shared->prod.full, 1, memory_order_relaxed);
}

og_status og_ring_wait_writable(og_ring *ring, uint32_t length, int64_t timeout_ns) {
    og_ring_shared *s = ring->shared;
    if (length > og_ring_max_payload(ring->mask + 1))
        return OG_TOO_BIG;
    return sleep_on(ring, &s->prod.sleeping, has_room, length, timeout_ns, &s->cons.pid);
}

/* ---- consumer -------------------------------------------------------------------------- */

static inline void release_to(og_ring *ring, uint64_t tail) {
    atomic_store_explicit(&ring->shared->cons.tail, tail, memory_order_release);
    wake_if_sleeping(&ring->shared->prod.sleeping);
}

og_status og_ring_peek(og_ring *ring, og_record_header *out, const uint8_t **payload) {
    og_ring_shared *s = ring->shared;
    uint64_t cap = ring->mask + 1;
    uint64_t tail = atomic_load_explicit(&s->cons.tail, memory_order_relaxed);
    for (;;) {
        uint64_t head = atomic_load_explicit(&s->prod.head, memory_order_acquire);
        if (tail == head)
            return OG_EMPTY;
        uint64_t off = tail & ring->mask;
        uint64_t contiguous = cap - off;
        const og_record_header *h = (const og_record_header *)(ring->data + off);
        if (contiguous < HDR || h->kind == OG_KIND_WRAP) {
            tail += contiguous;
            release_to(ring, tail);
            continue;
        }
        uint64_t total = align_up(HDR + h->length);
        if (total > contiguous || total > head - tail)
            return OG_CORRUPT;
        og_control_shared *c = ring->control;
        if (c && !(h->flags & OG_FLAG_NO_PURGE) && h->session < c->max_sessions) {
            uint32_t current =
                atomic_load_explicit(&c->epochs[h->session], memory_order_acquire);
            if ((int32_t)(h->epoch - current) < 0) { /* older epoch, wrap-safe */
                tail += total;
                atomic_fetch_add_explicit(&s->cons.skipped, 1, memory_order_relaxed);
                release_to(ring, tail);
                continue;
            }
        }
        memcpy(out, h, HDR);
        *payload = ring->data + off + HDR;
        ring->peek_end = tail + total;
        return OG_OK;
    }
}

void og_ring_advance(og_ring *ring) {
    og_ring_shared *s = ring->shared;
    uint64_t popped = atomic_load_explicit(&s->cons.popped, memory_order_relaxed);
    atomic_store_explicit(&s->cons.popped, popped + 1, memory_order_relaxed);
    release_to(ring, ring->peek_end);
}

static int has_data(og_ring *ring, uint64_t unused) {
    (void)unused;
    og_ring_shared *s = ring->shared;
    return atomic_load_explicit(&s->prod.head, memory_order_acquire) !=
           atomic_load_explicit(&s->cons.tail, memory_order_relaxed);
}

og_status og_ring_wait_readable(og_ring *ring, int64_t timeout_ns) {
    og_ring_shared *s = ring->shared;
    return sleep_on(ring, &s->cons.sleeping, has_data, 0, timeout_ns, &s->prod.pid);
}
