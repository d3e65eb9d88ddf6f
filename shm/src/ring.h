/* Single-producer single-consumer record ring in a shared-memory segment.
 *
 * Plain C, no Python: every function returns an og_status and the binding in _ring.c turns
 * statuses into exceptions. Layout of a ring segment:
 *
 *   [og_ring_meta]        magic, version, capacity, owner pid          (cache line 0)
 *   [og_ring_producer]    head, records pushed, producer pid, sleeping (cache line 2)
 *   [og_ring_consumer]    tail, records popped/skipped, consumer pid   (cache line 4)
 *   [data: capacity bytes, a power of two]
 *
 * head and tail are byte positions that only grow; position & (capacity - 1) is the offset.
 * Records are 8-byte aligned and never split: when a record does not fit before the end of the
 * data area the producer writes a WRAP marker (or leaves a gap shorter than a header, which the
 * consumer skips by the same rule) and starts the record at offset 0.
 *
 * A control segment holds one epoch per session. A consumer never delivers a record whose epoch is
 * older than its session's epoch: CANCEL is one atomic increment, whatever is queued.
 */
#ifndef OG_RING_H
#define OG_RING_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define OG_RING_MAGIC 0x474E4952494E4D4FULL    /* "OMNIRING" */
#define OG_CONTROL_MAGIC 0x4C52544E43494E4FULL /* "ONICNTRL" */
#define OG_LAYOUT_VERSION 1u
#define OG_CACHE_LINE 128 /* two lines: the adjacent-line prefetcher pairs them on x86 */
#define OG_RECORD_ALIGN 8u

/* kind values at or above this are reserved by the ring itself */
#define OG_KIND_RESERVED 0xFF00u
#define OG_KIND_WRAP 0xFFFFu
/* record flag: deliver whatever the session's epoch (session open/close, cancel itself) */
#define OG_FLAG_NO_PURGE 0x8000u

typedef enum {
    OG_OK = 0,
    OG_EMPTY = 1,       /* nothing to pop (non-blocking) */
    OG_FULL = 2,        /* no room to push (non-blocking) */
    OG_TIMEOUT = 3,     /* a blocking call ran out of time */
    OG_INTERRUPTED = 4, /* a signal arrived while sleeping; the caller checks its handlers */
    OG_PEER_DIED = 5,   /* the process on the other end is gone */
    OG_TOO_BIG = 6,     /* the record can never fit in this ring */
    OG_BAD_MAGIC = 7,
    OG_BAD_VERSION = 8,
    OG_BAD_SIZE = 9,    /* segment smaller than its header claims */
    OG_BAD_SESSION = 10,/* session id outside the control segment */
    OG_CORRUPT = 11,    /* a record header that cannot be right */
    OG_NO_SLOT = 12,    /* every session slot is taken */
} og_status;

/* 32 bytes in front of every payload. */
typedef struct {
    uint32_t length; /* payload bytes */
    uint16_t kind;
    uint16_t flags;
    uint32_t session;
    uint32_t epoch;
    uint64_t seq;
    uint64_t t_ns; /* CLOCK_MONOTONIC at push */
} og_record_header;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t meta_size;
    uint64_t capacity;
    int32_t owner_pid;
    uint32_t _pad;
    uint64_t created_ns;
} og_ring_meta;

typedef struct {
    _Atomic uint64_t head;
    _Atomic uint64_t pushed;
    _Atomic uint64_t full; /* pushes refused because the ring was full */
    _Atomic int32_t pid;
    _Atomic uint32_t sleeping; /* futex word: the producer waits for room */
} og_ring_producer;

typedef struct {
    _Atomic uint64_t tail;
    _Atomic uint64_t popped;
    _Atomic uint64_t skipped; /* records dropped because their epoch was stale */
    _Atomic int32_t pid;
    _Atomic uint32_t sleeping; /* futex word: the consumer waits for data */
} og_ring_consumer;

typedef struct {
    og_ring_meta meta;
    char _pad0[2 * OG_CACHE_LINE - sizeof(og_ring_meta)];
    og_ring_producer prod;
    char _pad1[2 * OG_CACHE_LINE - sizeof(og_ring_producer)];
    og_ring_consumer cons;
    char _pad2[2 * OG_CACHE_LINE - sizeof(og_ring_consumer)];
} og_ring_shared;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t max_sessions;
    int32_t owner_pid;
    uint32_t _pad;
    uint64_t created_ns;
    char _pad0[OG_CACHE_LINE - 32];
    _Atomic uint32_t epochs[]; /* one per session, then one slot state per session */
} og_control_shared;

/* slot states after the epochs: who holds each session id */
#define OG_SLOT_FREE 0u

/* A process-local handle on a mapped ring. */
typedef struct {
    og_ring_shared *shared;
    uint8_t *data;
    uint64_t mask;
    og_control_shared *control; /* may be NULL: no epoch filtering */
    /* consumer-local: the record returned by og_ring_peek, consumed by og_ring_advance */
    uint64_t peek_end;
    /* producer-local: whether og_ring_push yields its CPU to a consumer it woke after a quiet
     * spell (0: never), and when it last woke the consumer */
    int wake_yield;
    uint64_t last_wake_ns;
} og_ring;

/* A wake ends a quiet spell when the producer's previous wake is older than this. */
#define OG_YIELD_AFTER_NS 100000u

size_t og_ring_segment_size(uint64_t capacity);
size_t og_control_segment_size(uint32_t max_sessions);
uint64_t og_ring_max_payload(uint64_t capacity);
uint64_t og_monotonic_ns(void);

/* Owner side: lay out a fresh, zeroed segment. */
void og_ring_init(void *base, uint64_t capacity, int32_t owner_pid);
void og_control_init(void *base, uint32_t max_sessions, int32_t owner_pid);

/* Any side: validate a mapped segment and fill the handle. */
og_status og_ring_open(og_ring *ring, void *base, size_t segment_size);
og_status og_control_open(og_control_shared *control, size_t segment_size);

/* Epochs. */
og_status og_control_epoch(og_control_shared *c, uint32_t session, uint32_t *epoch);
og_status og_control_cancel(og_control_shared *c, uint32_t session, uint32_t *new_epoch);
/* A mirror of another host's segment: raise the session's epoch to `epoch` unless it is already
 * there or past it (32-bit, wrap-safe, as consumers compare); `*now` is the epoch after. */
og_status og_control_advance(og_control_shared *c, uint32_t session, uint32_t epoch,
                             uint32_t *now);
/* Session slots, so that several processes can hand out session ids without clashing:
 * claim a free slot for `holder_pid` (its epoch is bumped, purging anything a previous holder
 * left queued), release it, read who holds it (0 when free). A claim looks only at the slots
 * first, first + step, first + 2 step, ...: processes that share the segment take disjoint
 * strides, so the session id alone says which of them owns a session. */
og_status og_control_claim(og_control_shared *c, int32_t holder_pid, uint32_t first, uint32_t step,
                           uint32_t *session);
og_status og_control_release(og_control_shared *c, uint32_t session);
og_status og_control_holder(og_control_shared *c, uint32_t session, int32_t *holder_pid);

/* Producer. `hdr` gives kind, flags, session and epoch; seq and t_ns are stamped here.
 * timeout_ns < 0 waits forever, 0 does not wait. Waiting happens in slices of at most
 * `slice_ns`; OG_INTERRUPTED and OG_PEER_DIED end the wait early. */
og_status og_ring_push(og_ring *ring, og_record_header *hdr, const void *payload,
                       uint32_t length);
og_status og_ring_wait_writable(og_ring *ring, uint32_t length, int64_t timeout_ns);
/* The producer gave up on a full ring: count it once per refused push, not per retry. */
void og_ring_count_full(og_ring *ring);

/* Consumer: peek at the next deliverable record (stale epochs are skipped and counted), read it
 * in place, then advance past it. */
og_status og_ring_peek(og_ring *ring, og_record_header *hdr, const uint8_t **payload);
void og_ring_advance(og_ring *ring);
og_status og_ring_wait_readable(og_ring *ring, int64_t timeout_ns);

/* True when pid names a live process (or one we may not signal). */
int og_pid_alive(int32_t pid);

#endif
