// Keeps kspec._C loadable on glibc 2.28 (manylinux_2_28: RHEL 8, Ubuntu 20.04/22.04, Debian 10) when it is
// built on a newer one. The linker binds every libc call to the newest version of the symbol it sees, so
// a build on Debian 12 needs glibc 2.36. Each such symbol is redirected here with `-Wl,--wrap=<name>`
// (CMakeLists.txt lists them), which also catches the references inside the static libstdc++/libgcc the
// module links, and forwarded to a version glibc 2.28 has, or implemented on top of one.
// tools/wheel_check.sh fails when auditwheel finds a policy newer than manylinux_2_28.
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

// Bind a local name to an old version of a glibc symbol (x86_64's first glibc version is GLIBC_2.2.5), and
// make __wrap_<name> call it. `params` and `args` are parenthesized lists.
#define KSPEC_OLD_AS(ret, name, target, version, params)             \
  __asm__(".symver kspec_old_" #name ", " #target "@" version);      \
  extern "C" ret kspec_old_##name params;
#define KSPEC_FORWARD_TO(ret, name, target, version, params, args) \
  KSPEC_OLD_AS(ret, name, target, version, params)                 \
  extern "C" ret __wrap_##name params { return kspec_old_##name args; }
#define KSPEC_FORWARD(ret, name, version, params, args) KSPEC_FORWARD_TO(ret, name, name, version, params, args)

// libm 2.29 gave exp/log/log2/pow new entry points (no SVID error handling); the old ones compute the
// same values.
KSPEC_FORWARD(double, exp, "GLIBC_2.2.5", (double x), (x))
KSPEC_FORWARD(double, log, "GLIBC_2.2.5", (double x), (x))
KSPEC_FORWARD(double, log2, "GLIBC_2.2.5", (double x), (x))
KSPEC_FORWARD(double, pow, "GLIBC_2.2.5", (double x, double y), (x, y))

// glibc 2.34 merged libdl and libpthread into libc under new versions; the GLIBC_2.2.5 ones are the same
// functions (in libdl.so.2 / libpthread.so.0 before 2.34, which the module also names as NEEDED).
KSPEC_FORWARD(void*, dlopen, "GLIBC_2.2.5", (const char* f, int m), (f, m))
KSPEC_FORWARD(void*, dlsym, "GLIBC_2.2.5", (void* h, const char* s), (h, s))
KSPEC_FORWARD(char*, dlerror, "GLIBC_2.2.5", (void), ())
KSPEC_FORWARD(int, dladdr, "GLIBC_2.2.5", (const void* a, Dl_info* i), (a, i))
KSPEC_FORWARD(int, pthread_create, "GLIBC_2.2.5",
              (pthread_t* t, const pthread_attr_t* a, void* (*f)(void*), void* arg), (t, a, f, arg))
KSPEC_FORWARD(int, pthread_detach, "GLIBC_2.2.5", (pthread_t t), (t))
KSPEC_FORWARD(int, pthread_join, "GLIBC_2.2.5", (pthread_t t, void** r), (t, r))
KSPEC_FORWARD(void*, pthread_getspecific, "GLIBC_2.2.5", (pthread_key_t k), (k))
KSPEC_FORWARD(int, pthread_setspecific, "GLIBC_2.2.5", (pthread_key_t k, const void* v), (k, v))
KSPEC_FORWARD(int, pthread_key_create, "GLIBC_2.2.5", (pthread_key_t* k, void (*d)(void*)), (k, d))
KSPEC_FORWARD(int, __pthread_key_create, "GLIBC_2.2.5", (pthread_key_t* k, void (*d)(void*)), (k, d))
KSPEC_FORWARD(int, pthread_key_delete, "GLIBC_2.2.5", (pthread_key_t k), (k))
KSPEC_FORWARD(int, pthread_once, "GLIBC_2.2.5", (pthread_once_t* o, void (*f)()), (o, f))
KSPEC_FORWARD(int, pthread_rwlock_rdlock, "GLIBC_2.2.5", (pthread_rwlock_t* l), (l))
KSPEC_FORWARD(int, pthread_rwlock_wrlock, "GLIBC_2.2.5", (pthread_rwlock_t* l), (l))
KSPEC_FORWARD(int, pthread_rwlock_unlock, "GLIBC_2.2.5", (pthread_rwlock_t* l), (l))

// Before 2.33 stat/fstat/lstat were inline calls of __xstat & co. with a layout version (1 on x86_64,
// the kernel's struct stat, which is also struct stat64 there).
constexpr int kStatVer = 1;
KSPEC_OLD_AS(int, __xstat, __xstat, "GLIBC_2.2.5", (int, const char*, struct stat*))
KSPEC_OLD_AS(int, __lxstat, __lxstat, "GLIBC_2.2.5", (int, const char*, struct stat*))
KSPEC_OLD_AS(int, __fxstat, __fxstat, "GLIBC_2.2.5", (int, int, struct stat*))
extern "C" int __wrap_stat(const char* p, struct stat* s) { return kspec_old___xstat(kStatVer, p, s); }
extern "C" int __wrap_lstat(const char* p, struct stat* s) { return kspec_old___lxstat(kStatVer, p, s); }
extern "C" int __wrap_fstat(int fd, struct stat* s) { return kspec_old___fxstat(kStatVer, fd, s); }
extern "C" int __wrap_fstat64(int fd, struct stat* s) { return kspec_old___fxstat(kStatVer, fd, s); }

// glibc ≥ 2.38 headers (Ubuntu 24.04's) map strtol & co. to C23 variants, which also read "0b" prefixes;
// kspec parses decimal only, so the C99 ones are equivalent.
KSPEC_FORWARD_TO(long, __isoc23_strtol, strtol, "GLIBC_2.2.5", (const char* s, char** e, int b), (s, e, b))
KSPEC_FORWARD_TO(long long, __isoc23_strtoll, strtoll, "GLIBC_2.2.5", (const char* s, char** e, int b),
                 (s, e, b))
KSPEC_FORWARD_TO(unsigned long, __isoc23_strtoul, strtoul, "GLIBC_2.2.5", (const char* s, char** e, int b),
                 (s, e, b))
KSPEC_FORWARD_TO(unsigned long long, __isoc23_strtoull, strtoull, "GLIBC_2.2.5",
                 (const char* s, char** e, int b), (s, e, b))

// libstdc++ (GCC ≥ 11) skips atomic reference counts while glibc (≥ 2.32) says the process has one
// thread. Without that variable it must assume several: always atomic, always correct.
extern "C" {
char __wrap___libc_single_threaded = 0;
}

// std::random_device's fallback in GCC 12's libstdc++ (glibc ≥ 2.36): the same bytes from getentropy
// (GLIBC_2.25).
extern "C" uint32_t __wrap_arc4random() {
  uint32_t v = 0;
  if (getentropy(&v, sizeof v) != 0) std::abort();  // only without getrandom(2): Linux < 3.17
  return v;
}

// The unwinder in GCC ≥ 12's static libgcc finds a PC's .eh_frame with _dl_find_object (glibc 2.35)
// and has no other way once built against it; older glibc offers the same answer via dl_iterate_phdr,
// which is how the unwinder did it before (slower, but only exceptions pay for it). Built only against
// glibc ≥ 2.35 headers, the ones whose libgcc can call it.
#ifdef DLFO_STRUCT_HAS_EH_DBASE
namespace {
struct FindObject {
  uintptr_t pc;
  dl_find_object* out;
};

int find_object_in(dl_phdr_info* info, size_t, void* data) {
  auto* q = static_cast<FindObject*>(data);
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  bool contains = false;
  const void* eh_frame = nullptr;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_LOAD) {
      if (start < lo) lo = start;
      if (start + ph.p_memsz > hi) hi = start + ph.p_memsz;
      if (q->pc >= start && q->pc < start + ph.p_memsz) contains = true;
    } else if (ph.p_type == PT_GNU_EH_FRAME) {
      eh_frame = reinterpret_cast<const void*>(start);
    }
  }
  if (!contains) return 0;
  q->out->dlfo_flags = 0;
  q->out->dlfo_map_start = reinterpret_cast<void*>(lo);
  q->out->dlfo_map_end = reinterpret_cast<void*>(hi);
  q->out->dlfo_link_map = nullptr;  // not read by the unwinder
  q->out->dlfo_eh_frame = const_cast<void*>(eh_frame);
  return 1;
}
}  // namespace

extern "C" int __wrap__dl_find_object(void* pc, dl_find_object* out) {
  FindObject q{reinterpret_cast<uintptr_t>(pc), out};
  return dl_iterate_phdr(find_object_in, &q) == 1 ? 0 : -1;
}
#endif
