/* k3emu_stderr.h — for the emulator's C++ tests (test_cuda_emu, test_cuda_mma, test_cuda_graph):
 * run a callable with stderr captured, to check the `k3emu:` lines a broken kernel or a forbidden
 * call prints. Each test wraps it with its own CHECK of *ok. */
#ifndef K3EMU_STDERR_H
#define K3EMU_STDERR_H

#include <cstdio>
#include <string>
#include <unistd.h>

/* Runs f with stderr captured; returns what it printed (echoed, marked as expected). *ok = false
 * when stderr cannot be captured: f then runs uncaptured and "" is returned. */
template <class F> static std::string k3emu_captured_stderr(F f, bool *ok) {
    fflush(stderr);
    FILE *tmp = tmpfile();
    const int saved = dup(2);
    *ok = tmp && saved >= 0;
    if (!*ok) {
        if (tmp) fclose(tmp);
        if (saved >= 0) close(saved);
        f();
        return std::string();
    }
    dup2(fileno(tmp), 2);
    f();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    std::string s;
    rewind(tmp);
    char buf[512];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, tmp)) > 0) s.append(buf, got);
    fclose(tmp);
    if (!s.empty()) fprintf(stderr, "  (expected) %s", s.c_str());
    return s;
}

#endif
