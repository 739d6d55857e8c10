// hostcuda's NVRTC: the entry points tern's src/cuda/nvrtc.rs calls, compiling a kernel source
// for the CPU instead of a GPU (see kernel.h for what the result models).
//
// nvrtcCompileProgram writes the program to a private folder and runs translate.py (found beside
// this library) on it, which makes a shared object; the "CUBIN" handed back is that object behind
// a 24-byte header (16 bytes "TERNHOSTCUDA\0\0\0\0", then its length as a little-endian u64),
// the image hostcuda's cuModuleLoadData accepts. The version reported is 0.1, not an NVRTC
// release: tern's kernel cache keys on the version, so these images never mix with real CUBINs
// in a shared cache folder.

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Program {
    std::string source, name, log;
    std::vector<char> image;
};

enum : int { NVRTC_SUCCESS = 0, NVRTC_ERROR_INVALID_INPUT = 3, NVRTC_ERROR_INVALID_PROGRAM = 4, NVRTC_ERROR_COMPILATION = 6 };

std::string here() {
    Dl_info info;
    if (!dladdr((void*)&here, &info) || !info.dli_fname) return ".";
    std::string p = info.dli_fname;
    const size_t slash = p.rfind('/');
    return slash == std::string::npos ? "." : p.substr(0, slash);
}

// Runs argv, its stdout and stderr into *log; returns the exit status (-1 if it did not run).
int run(const std::vector<std::string>& argv, std::string* log) {
    int pipefd[2];
    if (pipe(pipefd) != 0) return -1;
    const pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        dup2(pipefd[1], 1);
        dup2(pipefd[1], 2);
        close(pipefd[0]);
        close(pipefd[1]);
        std::vector<char*> args;
        for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
        args.push_back(nullptr);
        execvp(args[0], args.data());
        _exit(127);
    }
    close(pipefd[1]);
    char buf[4096];
    ssize_t n;
    while ((n = read(pipefd[0], buf, sizeof buf)) > 0) log->append(buf, (size_t)n);
    close(pipefd[0]);
    int status = 0;
    if (waitpid(pid, &status, 0) < 0) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

extern "C" {

int nvrtcVersion(int* major, int* minor) {
    *major = 0;
    *minor = 1;
    return NVRTC_SUCCESS;
}

const char* nvrtcGetErrorString(int status) {
    switch (status) {
        case NVRTC_SUCCESS: return "NVRTC_SUCCESS (hostcuda)";
        case NVRTC_ERROR_INVALID_INPUT: return "NVRTC_ERROR_INVALID_INPUT (hostcuda)";
        case NVRTC_ERROR_INVALID_PROGRAM: return "NVRTC_ERROR_INVALID_PROGRAM (hostcuda)";
        case NVRTC_ERROR_COMPILATION: return "NVRTC_ERROR_COMPILATION (hostcuda: see the log)";
        default: return "NVRTC error (hostcuda)";
    }
}

int nvrtcCreateProgram(void** prog, const char* src, const char* name, int num_headers, const char* const*, const char* const*) {
    if (!prog || !src || num_headers != 0) return NVRTC_ERROR_INVALID_INPUT;
    Program* p = new Program;
    p->source = src;
    p->name = name ? name : "program";
    *prog = p;
    return NVRTC_SUCCESS;
}

int nvrtcDestroyProgram(void** prog) {
    if (!prog || !*prog) return NVRTC_ERROR_INVALID_PROGRAM;
    delete static_cast<Program*>(*prog);
    *prog = nullptr;
    return NVRTC_SUCCESS;
}

// The options (architecture, include path, -default-device) do not change the host build.
int nvrtcCompileProgram(void* prog, int, const char* const*) {
    Program* p = static_cast<Program*>(prog);
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    const char* tmp = getenv("TMPDIR");
    std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/hostcuda-XXXXXX";
    if (!mkdtemp(&dir[0])) {
        p->log = "hostcuda: cannot make a temporary folder";
        return NVRTC_ERROR_COMPILATION;
    }
    const std::string cu = dir + "/" + p->name + ".cu", so = dir + "/" + p->name + ".so";
    {
        std::ofstream f(cu, std::ios::binary);
        f << p->source;
    }
    const char* python = getenv("TERN_HOSTCUDA_PYTHON");
    const int status = run({python && *python ? python : "python3", here() + "/translate.py", cu, so}, &p->log);
    if (status == 0) {
        std::ifstream f(so, std::ios::binary);
        std::stringstream bytes;
        bytes << f.rdbuf();
        const std::string body = bytes.str();
        const uint64_t n = body.size();
        p->image.assign("TERNHOSTCUDA\0\0\0\0", "TERNHOSTCUDA\0\0\0\0" + 16);
        for (int i = 0; i < 8; ++i) p->image.push_back((char)(n >> (8 * i)));
        p->image.insert(p->image.end(), body.begin(), body.end());
    }
    if (!getenv("TERN_HOSTCUDA_KEEP")) {
        unlink(cu.c_str());
        unlink(so.c_str());
        rmdir(dir.c_str());
    }
    if (status != 0) {
        if (p->log.empty()) p->log = "hostcuda: translate.py failed to run";
        return NVRTC_ERROR_COMPILATION;
    }
    return NVRTC_SUCCESS;
}

int nvrtcGetProgramLogSize(void* prog, size_t* size) {
    const Program* p = static_cast<Program*>(prog);
    if (!p || !size) return NVRTC_ERROR_INVALID_INPUT;
    *size = p->log.size() + 1;
    return NVRTC_SUCCESS;
}

int nvrtcGetProgramLog(void* prog, char* log) {
    const Program* p = static_cast<Program*>(prog);
    if (!p || !log) return NVRTC_ERROR_INVALID_INPUT;
    memcpy(log, p->log.c_str(), p->log.size() + 1);
    return NVRTC_SUCCESS;
}

int nvrtcGetCUBINSize(void* prog, size_t* size) {
    const Program* p = static_cast<Program*>(prog);
    if (!p || !size) return NVRTC_ERROR_INVALID_INPUT;
    *size = p->image.size();
    return NVRTC_SUCCESS;
}

int nvrtcGetCUBIN(void* prog, char* out) {
    const Program* p = static_cast<Program*>(prog);
    if (!p || !out) return NVRTC_ERROR_INVALID_INPUT;
    memcpy(out, p->image.data(), p->image.size());
    return NVRTC_SUCCESS;
}

}  // extern "C"
