// Malloc trace shim used for docs/estimator.md (NCHWc / load-buffer sequence): logs every block >= 64 KiB.
// gcc -O2 -shared -fPIC -o $WORK/mtrace.so bench/estimator/mtrace.c
// MTRACE_SO=$WORK/mtrace.so MTRACE_FILE=$WORK/conv_emb.log LD_PRELOAD=$WORK/mtrace.so python -m bench.estimator.mtrace_run MODEL.onnx
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
#define MIN_SZ (64*1024)
#define HS (1<<20)
static void *keys[HS]; static size_t vals[HS];
static int fd = -1; static int on = 0;
static void logit(char k, void *p, size_t sz) {
  if (fd < 0) { const char *f = getenv("MTRACE_FILE"); if (!f) return; fd = open(f, O_WRONLY|O_CREAT|O_TRUNC, 0644); if (fd < 0) return; }
  char b[96]; int n = snprintf(b, sizeof b, "%c %lx %zu\n", k, (unsigned long)p, sz); write(fd, b, n);
}
static void put(void *p, size_t sz) { size_t h = ((uintptr_t)p >> 4) & (HS-1); while (keys[h] && keys[h] != p) h = (h+1)&(HS-1); keys[h] = p; vals[h] = sz; }
static size_t take(void *p) { size_t h = ((uintptr_t)p >> 4) & (HS-1); while (keys[h]) { if (keys[h] == p) { size_t s = vals[h]; keys[h] = (void*)1; vals[h]=0; return s; } h = (h+1)&(HS-1);} return 0; }
static void track(void *p, size_t sz) { if (p && sz >= MIN_SZ) { put(p, sz); logit('a', p, sz); } }
static void untrack(void *p) { if (!p) return; size_t s = take(p); if (s) logit('f', p, s); }
void mtrace_mark(const char *m) { if (fd >= 0) { write(fd, "# ", 2); write(fd, m, strlen(m)); write(fd, "\n", 1);} }
void *malloc(size_t n) { void *p = __libc_malloc(n); track(p, n); return p; }
void free(void *p) { untrack(p); __libc_free(p); }
void *calloc(size_t a, size_t b) { void *p = __libc_calloc(a, b); track(p, a*b); return p; }
void *realloc(void *o, size_t n) { untrack(o); void *p = __libc_realloc(o, n); track(p, n); return p; }
void *memalign(size_t al, size_t n) { void *p = __libc_memalign(al, n); track(p, n); return p; }
int posix_memalign(void **r, size_t al, size_t n) { void *p = __libc_memalign(al, n); if (!p) return 12; *r = p; track(p, n); return 0; }
void *aligned_alloc(size_t al, size_t n) { void *p = __libc_memalign(al, n); track(p, n); return p; }
