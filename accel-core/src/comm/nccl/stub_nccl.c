// A stand-in for libnccl.so.2, built by the unit tests (comm/nccl/tests.rs) on machines
// without GPUs: the functions accel resolves, with behaviour the tests steer through
// stub_set(), and a log of every call (stub_log()). Communicators are of one rank: data
// moves as NCCL would move it for a world of one.
//
// Build variants: -DSTUB_VERSION=N reports another version; -DSTUB_OMIT_SPLIT leaves out
// ncclCommSplit.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef STUB_VERSION
#define STUB_VERSION 22809
#endif

typedef struct {
  int polls_left;
  int async_error;
  int finalize_polls;
  int busy;  // calls inside this communicator now: more than one is an overlap
} stub_comm;

typedef struct {
  char internal[128];
} stub_unique_id;

typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
} stub_config_head;

static char log_text[1 << 16];
static int init_polls = 3;
static int init_result = 0;
static int async_error = 0;
static int fail_count = -1;
static stub_comm* last_comm = NULL;
static int linger_us = 0;

static void note(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void note(const char* fmt, ...) {
  size_t used = strlen(log_text);
  va_list args;
  va_start(args, fmt);
  vsnprintf(log_text + used, sizeof(log_text) - used, fmt, args);
  va_end(args);
  used = strlen(log_text);
  if (used + 1 < sizeof(log_text)) strcat(log_text, "\n");
}

// Test controls.
void stub_set(const char* key, int value) {
  if (strcmp(key, "init_polls") == 0) init_polls = value;
  if (strcmp(key, "init_result") == 0) init_result = value;
  if (strcmp(key, "async_error") == 0) {
    async_error = value;
    if (last_comm) last_comm->async_error = value;
  }
  if (strcmp(key, "fail_count") == 0) fail_count = value;
  if (strcmp(key, "linger_us") == 0) linger_us = value;
}
const char* stub_log(void) { return log_text; }

int ncclGetVersion(int* version) {
  *version = STUB_VERSION;
  return 0;
}

int ncclGetUniqueId(stub_unique_id* id) {
  for (int i = 0; i < 128; i++) id->internal[i] = (char)i;
  note("ncclGetUniqueId");
  return 0;
}

static stub_comm* new_comm(void) {
  stub_comm* comm = calloc(1, sizeof(stub_comm));
  comm->polls_left = init_polls;
  comm->async_error = async_error;
  last_comm = comm;
  return comm;
}

int ncclCommInitRankConfig(stub_comm** comm, int nranks, stub_unique_id id, int rank,
                           stub_config_head* config) {
  note("ncclCommInitRankConfig nranks=%d rank=%d id1=%d size=%zu magic=%x version=%u blocking=%d",
       nranks, rank, (int)id.internal[1], config->size, config->magic, config->version,
       config->blocking);
  if (init_result != 0) return init_result;
  *comm = new_comm();
  if (config->blocking) {
    (*comm)->polls_left = 0;
    return 0;  // a blocking communicator is ready when the call returns
  }
  return 7;  // ncclInProgress: a non-blocking communicator finishes later
}

#ifndef STUB_OMIT_SPLIT
int ncclCommSplit(stub_comm* comm, int color, int key, stub_comm** newcomm,
                  stub_config_head* config) {
  note("ncclCommSplit color=%d key=%d blocking=%d", color, key, config->blocking);
  *newcomm = color < 0 ? NULL : new_comm();
  if (config->blocking) {
    if (*newcomm) (*newcomm)->polls_left = 0;
    return 0;
  }
  return 7;
}
#endif

// Marks a call on `comm` (NCCL 2.28 forbids overlapping ones: ncclCommGetAsyncError may free
// a group job another call is using); an overlap is logged as "OVERLAP". `linger_us` widens
// the window a racing caller would hit.
static void enter_comm(stub_comm* comm, const char* call) {
  if (__atomic_fetch_add(&comm->busy, 1, __ATOMIC_SEQ_CST) != 0) note("OVERLAP in %s", call);
  if (linger_us > 0) {
    struct timespec pause = {0, (long)linger_us * 1000};
    nanosleep(&pause, NULL);
  }
}
static void leave_comm(stub_comm* comm) { __atomic_fetch_sub(&comm->busy, 1, __ATOMIC_SEQ_CST); }

int ncclCommGetAsyncError(stub_comm* comm, int* state) {
  enter_comm(comm, "ncclCommGetAsyncError");
  leave_comm(comm);
  if (comm->polls_left > 0) {
    comm->polls_left--;
    *state = 7;
  } else {
    *state = comm->async_error;
  }
  return 0;
}

int ncclCommAbort(stub_comm* comm) {
  note("ncclCommAbort");
  if (last_comm == comm) last_comm = NULL;
  free(comm);
  return 0;
}

int ncclCommFinalize(stub_comm* comm) {
  enter_comm(comm, "ncclCommFinalize");
  leave_comm(comm);
  note("ncclCommFinalize");
  comm->polls_left = 2;
  return 7;
}

int ncclCommDestroy(stub_comm* comm) {
  note("ncclCommDestroy");
  if (last_comm == comm) last_comm = NULL;
  free(comm);
  return 0;
}

const char* ncclGetErrorString(int result) {
  static char text[64];
  snprintf(text, sizeof(text), "stub error string %d", result);
  return text;
}

const char* ncclGetLastError(stub_comm* comm) {
  (void)comm;
  return fail_count >= 0 ? "the stub refuses this count" : "";
}

static int data_op(const char* name, const void* send, void* recv, size_t count, size_t bytes,
                   int datatype) {
  note("%s count=%zu datatype=%d", name, count, datatype);
  if ((long)count == fail_count) return 4;  // ncclInvalidArgument
  if (send != recv && send != NULL && recv != NULL) memmove(recv, send, bytes);
  return 0;
}

static size_t size_of(int datatype) {
  switch (datatype) {
    case 0: case 1: case 10: case 11: return 1;
    case 6: case 9: return 2;
    case 2: case 3: case 7: return 4;
    default: return 8;
  }
}

int ncclAllReduce(const void* send, void* recv, size_t count, int datatype, int op,
                  stub_comm* comm, void* stream) {
  (void)comm; (void)stream;
  note("ncclAllReduce op=%d", op);
  return data_op("  data", send, recv, count, count * size_of(datatype), datatype);
}

int ncclBroadcast(const void* send, void* recv, size_t count, int datatype, int root,
                  stub_comm* comm, void* stream) {
  (void)comm; (void)stream;
  note("ncclBroadcast root=%d", root);
  return data_op("  data", send, recv, count, count * size_of(datatype), datatype);
}

int ncclReduceScatter(const void* send, void* recv, size_t recvcount, int datatype, int op,
                      stub_comm* comm, void* stream) {
  (void)comm; (void)stream;
  note("ncclReduceScatter op=%d", op);
  return data_op("  data", send, recv, recvcount, recvcount * size_of(datatype), datatype);
}

int ncclAllGather(const void* send, void* recv, size_t sendcount, int datatype, stub_comm* comm,
                  void* stream) {
  (void)comm; (void)stream;
  note("ncclAllGather");
  return data_op("  data", send, recv, sendcount, sendcount * size_of(datatype), datatype);
}

int ncclSend(const void* send, size_t count, int datatype, int peer, stub_comm* comm,
             void* stream) {
  (void)send; (void)comm; (void)stream;
  note("ncclSend peer=%d", peer);
  return data_op("  data", NULL, NULL, count, 0, datatype);
}

int ncclRecv(void* recv, size_t count, int datatype, int peer, stub_comm* comm, void* stream) {
  (void)recv; (void)comm; (void)stream;
  note("ncclRecv peer=%d", peer);
  return data_op("  data", NULL, NULL, count, 0, datatype);
}

int ncclGroupStart(void) {
  note("ncclGroupStart");
  return 0;
}

int ncclGroupEnd(void) {
  note("ncclGroupEnd");
  return 0;
}
