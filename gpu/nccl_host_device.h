/* A host device brought by the NCCL library itself. A library loaded as NCCL
 * (CPSIM_NCCL_LIBRARY) that also exports `cpsimNcclHostDevice` runs its ranks on
 * host memory: the nccl backend then takes its streams and events from this table
 * instead of CUDA, keeps tensors of cuda:N in host memory and runs the host
 * kernels, so gpu/nccl.cpp (its calls, the watchdog, abort, job mode) runs on a
 * machine without a GPU. cpsim's NCCL test double (tests/doubles/nccl_double.cpp) is such a
 * library. A stream runs its work in order on its own thread, as a GPU stream
 * does; NCCL calls enqueue on it. */
#ifndef CPSIM_NCCL_HOST_DEVICE_H
#define CPSIM_NCCL_HOST_DEVICE_H

#ifdef __cplusplus
extern "C" {
#endif

#define CPSIM_NCCL_HOST_DEVICE_ABI 1

typedef struct cpsimNcclHostDeviceTable {
  int abi;     /* CPSIM_NCCL_HOST_DEVICE_ABI */
  int devices; /* how many cuda:N it offers */
  /* A new stream (the `cudaStream_t` its NCCL calls take); streams live as long as the process. */
  void* (*stream_create)(int device);
  /* Blocks until every task queued on `stream` has run, at most `timeout_ms`:
   * 0 when it has, 1 when the limit passed first (a call stuck inside it). */
  int (*stream_synchronize)(void* stream, long long timeout_ms);
  /* An event: recorded on a stream, done once the stream has reached it. */
  void* (*event_create)(void);
  void (*event_record)(void* event, void* stream);
  /* 1 when the event's last record has been reached (or it was never recorded), else 0. */
  int (*event_query)(void* event);
} cpsimNcclHostDeviceTable;

/* The exported entry point the nccl backend looks for. */
typedef const cpsimNcclHostDeviceTable* (*cpsimNcclHostDeviceFn)(void);

#ifdef __cplusplus
}
#endif

#endif
